// The fake device's stream-safety checker: which accesses to device memory no synchronisation
// orders, found as they happen although every kernel here runs synchronously.
//
// It follows CUDA's stream sanitizer (torch.cuda._sanitizer): every kernel gets a sequence
// number on its stream; each stream keeps a vector clock (for every other stream, the last
// sequence number it is known to run after); an event record snapshots the recording
// stream's clock, a wait merges the snapshot into the waiting stream's clock, a stream,
// event or device synchronize merges into every stream and into the host's clock (which a
// stream first seen later starts from). A storage keeps its last write and, per stream, its
// last read since that write; an access is unsynchronised when the accessing stream's clock
// does not cover the conflicting earlier access.
//
// Beyond the sanitizer: storages are whole allocations (a view's access is its base's), a
// storage's reads are kept per stream (the latest one stands for the earlier: same-stream
// order), and frees are checked as the caching allocators of accelerators make them matter.
// Freed memory goes back to the stream that allocated it, which may hand it out again at once:
// an access from another stream that the owner is not yet ordered after (and that
// record_stream did not name) is a hazard, and a kernel on the owner that touches memory it
// allocated after the free, before the owner is ordered after that access, is a reuse finding.
// Which allocation really gets the memory depends on sizes and the allocator; any of them
// may, so any of them counts.

#pragma once

#include <c10/core/Stream.h>

#include <cstddef>
#include <string>
#include <vector>

namespace fakeaccel::checker {

bool enabled();

// Start checking from a clean state (true), or stop (false); returns whether it was on.
bool set_enabled(bool on);

// While a Pause lives, this thread's kernels are not recorded: the work of a kernel that is
// itself recorded (a CPU fallback's copies, a backend's staging copies).
class Pause {
 public:
  Pause();
  ~Pause();
  static void push();  // the same, for a caller that cannot hold an object (Python)
  static void pop();
  Pause(const Pause&) = delete;
  Pause& operator=(const Pause&) = delete;
};

// One kernel on `stream`: the storages (allocation base pointers) it reads and writes.
void kernel(const std::string& op, c10::Stream stream, const std::vector<const void*>& reads,
            const std::vector<const void*>& writes);

void allocated(const void* base, c10::Stream stream, size_t bytes);
void freed(const void* base);
void record_stream(const void* base, c10::Stream stream);

void event_recorded(const void* event, c10::Stream stream);
void event_waited(const void* event, c10::Stream stream);
void event_destroyed(const void* event);

void stream_synchronized(c10::Stream stream);
void event_synchronized(const void* event);
void device_synchronized(c10::DeviceIndex device);

// The findings since the last call (each one report, both Python stacks included) and how
// many repeats of them were folded in.
std::vector<std::string> take_findings();

}  // namespace fakeaccel::checker
