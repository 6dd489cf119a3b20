// The stream-safety checker's state and rules (see stream_checker.h for the model).
//
// Locking: one mutex guards the state; Python stacks are gathered (which takes the GIL)
// before it is taken and symbolised after it is released, so the mutex is never held while
// waiting for the GIL, whichever thread holds that (frees run under the GIL from Python).

#include "stream_checker.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace fakeaccel::checker {
namespace {

using StreamKey = uint64_t;
using Clock = std::unordered_map<StreamKey, int64_t>;
using Stack = std::shared_ptr<torch::CapturedTraceback>;

constexpr uint64_t kIdMask = (uint64_t{1} << 56) - 1;
constexpr size_t kMaxFindings = 16;  // distinct ones kept with stacks; repeats are counted

StreamKey key_of(c10::Stream stream) {
  return (static_cast<uint64_t>(static_cast<uint8_t>(stream.device_index())) << 56) |
         (static_cast<uint64_t>(stream.id()) & kIdMask);
}

int device_of(StreamKey key) { return static_cast<int>(key >> 56); }
int64_t id_of(StreamKey key) { return static_cast<int64_t>(key & kIdMask); }

struct Access {
  StreamKey stream = 0;
  int64_t seq = 0;
  std::string op;
  Stack stack;
};

struct StorageState {
  size_t bytes = 0;
  std::optional<StreamKey> allocated_on;
  int64_t allocated_at = 0;
  std::optional<Access> write;
  std::unordered_map<StreamKey, Access> reads;  // since the write; the latest per stream
  std::vector<StreamKey> recorded_streams;      // record_stream
};

enum class Kind { Read, WriteAfterRead, WriteAfterWrite, Reuse };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::Read:
      return "read";
    case Kind::WriteAfterRead:
      return "write-after-read";
    case Kind::WriteAfterWrite:
      return "write-after-write";
    case Kind::Reuse:
      return "reuse";
  }
  return "?";
}

struct Finding {
  Kind kind;
  Access access;   // the access found unordered
  Access earlier;  // the access it conflicts with
  size_t bytes = 0;
  std::optional<StreamKey> allocated_on;
  int64_t repeats = 0;
  std::optional<Access> freed;  // Reuse: where the earlier access's memory was freed
};

// Memory freed back to `owner` (its allocating stream) while `earlier`, on another stream,
// may not have run yet: until `owner` is ordered after it, whatever `owner` allocates next
// may be that memory.
struct Hazard {
  Access earlier;
  Access freed;
  size_t bytes = 0;
  int64_t freed_at = 0;
};

struct State {
  std::mutex mutex;
  int64_t seq = 0;
  std::unordered_map<StreamKey, Clock> clocks;
  Clock host;  // what the host has synchronised with: a stream first seen starts here
  std::unordered_map<const void*, Clock> events;
  std::unordered_map<const void*, StorageState> storages;
  std::unordered_map<StreamKey, std::vector<Hazard>> hazards;  // by owning stream
  std::vector<Finding> findings;
};

std::atomic<bool> on{false};
thread_local int paused = 0;

State& state() {
  static State* instance = new State();  // never destroyed: frees may come at exit
  return *instance;
}

Stack gather_stack() {
  try {
    return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  } catch (...) {
    return nullptr;
  }
}

void merge(Clock& into, const Clock& from) {
  for (const auto& [stream, seq] : from) {
    auto& slot = into[stream];
    slot = std::max(slot, seq);
  }
}

// Callers hold the mutex.
Clock& clock_of(State& st, StreamKey stream) {
  auto found = st.clocks.find(stream);
  if (found == st.clocks.end()) {
    found = st.clocks.emplace(stream, st.host).first;
  }
  return found->second;
}

bool ordered_after(State& st, StreamKey stream, const Access& earlier) {
  if (earlier.stream == stream) {
    return true;
  }
  const Clock& clock = clock_of(st, stream);
  const auto seen = clock.find(earlier.stream);
  return seen != clock.end() && seen->second >= earlier.seq;
}

StorageState& storage_of(State& st, const void* base) { return st.storages[base]; }

void report(State& st, Kind kind, const Access& access, const Access& earlier,
            const StorageState& storage, const std::optional<Access>& freed = std::nullopt) {
  for (auto& finding : st.findings) {
    if (finding.kind == kind && finding.access.op == access.op &&
        finding.earlier.op == earlier.op && finding.access.stream == access.stream &&
        finding.earlier.stream == earlier.stream) {
      finding.repeats += 1;
      return;
    }
  }
  if (st.findings.size() >= kMaxFindings) {
    st.findings.back().repeats += 1;
    return;
  }
  st.findings.push_back({kind, access, earlier, storage.bytes, storage.allocated_on, 0, freed});
}

// A kernel on `here` touches memory `here` allocated after a hazard's free: the caching
// allocator may have handed it the freed memory. Hazards `here` is now ordered after, or
// that were reported, are dropped. Callers hold the mutex.
void check_reuse(State& st, StreamKey here, const Access& now, const std::vector<const void*>& touched) {
  auto found = st.hazards.find(here);
  if (found == st.hazards.end() || found->second.empty()) {
    return;
  }
  auto& hazards = found->second;
  std::vector<bool> reported(hazards.size(), false);
  for (const void* base : touched) {
    const StorageState& storage = storage_of(st, base);
    if (storage.allocated_on != here) {
      continue;
    }
    for (size_t i = 0; i < hazards.size(); ++i) {
      if (!reported[i] && hazards[i].freed_at < storage.allocated_at &&
          !ordered_after(st, here, hazards[i].earlier)) {
        report(st, Kind::Reuse, now, hazards[i].earlier, storage, hazards[i].freed);
        reported[i] = true;
      }
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < hazards.size(); ++i) {
    if (!reported[i] && !ordered_after(st, here, hazards[i].earlier)) {
      if (kept != i) {
        hazards[kept] = std::move(hazards[i]);
      }
      ++kept;
    }
  }
  hazards.resize(kept);
}

// --- rendering -------------------------------------------------------------------------------

std::string json_string(const std::string& text) {
  std::ostringstream out;
  out << '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out << "\\\"";
        break;
      case '\\':
        out << "\\\\";
        break;
      case '\n':
        out << "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out << "\\u00" << "0123456789abcdef"[(c >> 4) & 0xf] << "0123456789abcdef"[c & 0xf];
        } else {
          out << c;
        }
    }
  }
  out << '"';
  return out.str();
}

// Outermost frame first, as Python prints a traceback.
std::string json_stack(const Stack& stack) {
  if (!stack) {
    return "[]";
  }
  const auto symbolized = torch::symbolize({stack.get()});
  std::ostringstream out;
  out << '[';
  if (!symbolized.tracebacks.empty()) {
    const auto& frames = symbolized.tracebacks.front();
    bool first = true;
    for (auto index = frames.rbegin(); index != frames.rend(); ++index) {
      const auto& frame = symbolized.all_frames.at(*index);
      out << (first ? "" : ",") << '[' << json_string(frame.filename) << ',' << frame.lineno
          << ',' << json_string(frame.funcname) << ']';
      first = false;
    }
  }
  out << ']';
  return out.str();
}

std::string json_access(const Access& access) {
  std::ostringstream out;
  out << "{\"op\":" << json_string(access.op) << ",\"device\":" << device_of(access.stream)
      << ",\"stream\":" << id_of(access.stream) << ",\"stack\":" << json_stack(access.stack)
      << '}';
  return out.str();
}

std::string json_finding(const Finding& finding) {
  std::ostringstream out;
  out << "{\"kind\":\"" << kind_name(finding.kind) << "\",\"bytes\":" << finding.bytes
      << ",\"repeats\":" << finding.repeats << ",\"access\":" << json_access(finding.access)
      << ",\"earlier\":" << json_access(finding.earlier);
  if (finding.freed) {
    out << ",\"freed\":" << json_access(*finding.freed);
  }
  out << ",\"allocated_on\":";
  if (finding.allocated_on) {
    out << "{\"device\":" << device_of(*finding.allocated_on)
        << ",\"stream\":" << id_of(*finding.allocated_on) << '}';
  } else {
    out << "null";
  }
  out << '}';
  return out.str();
}

}  // namespace

bool enabled() { return on.load(std::memory_order_relaxed) && paused == 0; }

bool set_enabled(bool enable) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const bool was = on.exchange(enable);
  st.seq = 0;
  st.clocks.clear();
  st.host.clear();
  st.events.clear();
  st.storages.clear();
  st.hazards.clear();
  st.findings.clear();
  return was;
}

Pause::Pause() { push(); }
Pause::~Pause() { pop(); }
void Pause::push() { ++paused; }
void Pause::pop() { paused = std::max(0, paused - 1); }

void kernel(const std::string& op, c10::Stream stream, const std::vector<const void*>& reads,
            const std::vector<const void*>& writes) {
  if (!enabled()) {
    return;
  }
  Stack stack = gather_stack();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const StreamKey here = key_of(stream);
  const Access now{here, ++st.seq, op, std::move(stack)};
  clock_of(st, here)[here] = now.seq;
  for (const void* base : reads) {
    if (std::find(writes.begin(), writes.end(), base) != writes.end()) {
      continue;  // read and written: checked as a write
    }
    StorageState& storage = storage_of(st, base);
    if (storage.write && !ordered_after(st, here, *storage.write)) {
      report(st, Kind::Read, now, *storage.write, storage);
    }
    storage.reads.insert_or_assign(here, now);
  }
  for (const void* base : writes) {
    StorageState& storage = storage_of(st, base);
    if (!storage.reads.empty()) {
      for (const auto& [stream_key, read] : storage.reads) {
        if (!ordered_after(st, here, read)) {
          report(st, Kind::WriteAfterRead, now, read, storage);
        }
      }
    } else if (storage.write && !ordered_after(st, here, *storage.write)) {
      report(st, Kind::WriteAfterWrite, now, *storage.write, storage);
    }
    storage.write = now;
    storage.reads.clear();
  }
  std::vector<const void*> touched(reads);
  touched.insert(touched.end(), writes.begin(), writes.end());
  check_reuse(st, here, now, touched);
}

void allocated(const void* base, c10::Stream stream, size_t bytes) {
  if (!on.load(std::memory_order_relaxed) || base == nullptr) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  StorageState fresh;
  fresh.bytes = bytes;
  fresh.allocated_on = key_of(stream);
  fresh.allocated_at = ++st.seq;
  st.storages.insert_or_assign(base, std::move(fresh));
}

void freed(const void* base) {
  if (!on.load(std::memory_order_relaxed) || base == nullptr) {
    return;
  }
  State& st = state();
  std::vector<Access> unordered;
  StorageState storage;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    auto found = st.storages.find(base);
    if (found == st.storages.end()) {
      return;
    }
    storage = std::move(found->second);
    st.storages.erase(found);
    if (!storage.allocated_on) {
      return;  // allocated before checking began: which stream owns it is unknown
    }
    const StreamKey owner = *storage.allocated_on;
    std::vector<const Access*> accesses;
    for (const auto& [stream_key, read] : storage.reads) {
      accesses.push_back(&read);
    }
    if (storage.write) {
      accesses.push_back(&*storage.write);
    }
    for (const Access* access : accesses) {
      const auto& named = storage.recorded_streams;
      const bool recorded = std::find(named.begin(), named.end(), access->stream) != named.end();
      if (access->stream != owner && !recorded && !ordered_after(st, owner, *access)) {
        unordered.push_back(*access);
      }
    }
  }
  if (unordered.empty()) {
    return;
  }
  Stack stack = gather_stack();
  std::lock_guard<std::mutex> lock(st.mutex);
  const StreamKey owner = *storage.allocated_on;
  const Access free{owner, ++st.seq, "free", std::move(stack)};
  auto& hazards = st.hazards[owner];
  for (Access& access : unordered) {
    hazards.push_back({std::move(access), free, storage.bytes, free.seq});
  }
}

void record_stream(const void* base, c10::Stream stream) {
  if (!on.load(std::memory_order_relaxed) || base == nullptr) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  storage_of(st, base).recorded_streams.push_back(key_of(stream));
}

void event_recorded(const void* event, c10::Stream stream) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.events.insert_or_assign(event, clock_of(st, key_of(stream)));
}

void event_waited(const void* event, c10::Stream stream) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto found = st.events.find(event);
  if (found != st.events.end()) {  // else recorded before checking began
    merge(clock_of(st, key_of(stream)), found->second);
  }
}

void event_destroyed(const void* event) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.events.erase(event);
}

namespace {
// Every stream, and the host, now run after `done`. Callers hold the mutex.
void everyone_waits_for(State& st, const Clock& done) {
  for (auto& [stream_key, clock] : st.clocks) {
    merge(clock, done);
  }
  merge(st.host, done);
}
}  // namespace

void stream_synchronized(c10::Stream stream) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const Clock done = clock_of(st, key_of(stream));
  everyone_waits_for(st, done);
}

void event_synchronized(const void* event) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto found = st.events.find(event);
  if (found != st.events.end()) {
    const Clock done = found->second;
    everyone_waits_for(st, done);
  }
}

void device_synchronized(c10::DeviceIndex device) {
  if (!on.load(std::memory_order_relaxed)) {
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  Clock done;
  for (const auto& [stream_key, clock] : st.clocks) {
    if (device_of(stream_key) == static_cast<uint8_t>(device)) {
      merge(done, clock);
    }
  }
  everyone_waits_for(st, done);
}

std::vector<std::string> take_findings() {
  std::vector<Finding> taken;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    taken.swap(st.findings);
  }
  std::vector<std::string> rendered;
  rendered.reserve(taken.size());
  for (const auto& finding : taken) {
    rendered.push_back(json_finding(finding));
  }
  return rendered;
}

}  // namespace fakeaccel::checker
