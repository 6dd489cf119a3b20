// fakeaccel: a PrivateUse1 device for testing accelerator code paths on a CPU-only machine.
//
// Device memory is host memory obtained through this device's own allocator, with its own
// statistics per device: a fakeaccel tensor is never a CPU tensor, and moving one to or from
// the CPU copies. A handful of kernels are native (allocation, copies, views, resizing);
// every other operator runs on the CPU through torch's boxed CPU fallback (copy the
// inputs to the CPU, run, copy results and mutated inputs back).
//
// Work is synchronous: a kernel is complete when it returns, so events are complete as soon
// as they are recorded. What a real device makes observable by timing (a stream that did or
// did not wait for an event) is kept here as a record instead: every wait of a stream on an
// event is logged, and `torch.ops.fakeaccel.take_event_waits()` hands the log to Python.
// While the stream checker is on (`torch.ops.fakeaccel.stream_check(True)`, see
// stream_checker.h), every kernel, stream and event operation, allocation and free is also
// reported to it, and it finds the accesses a real device would leave unordered.
//
// Devices: FAKEACCEL_DEVICE_COUNT (default 8) per machine, narrowed per process by
// FAKEACCEL_VISIBLE_DEVICES (comma-separated indices), as CUDA_VISIBLE_DEVICES narrows GPUs.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include "stream_checker.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

namespace fakeaccel {
namespace {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;
constexpr size_t kNominalMemoryBytes = size_t{16} << 30;  // what getMemoryInfo reports
constexpr int kStreamPoolSize = 32;

// --- devices ---------------------------------------------------------------------------------

int machine_device_count() {
  const char* text = std::getenv("FAKEACCEL_DEVICE_COUNT");
  const int count = text ? std::atoi(text) : 8;
  TORCH_CHECK(count >= 0 && count <= kMaxDevices,
              "FAKEACCEL_DEVICE_COUNT must be between 0 and ", kMaxDevices, ", got ",
              text ? text : "");
  return count;
}

c10::DeviceIndex visible_device_count() {
  static const c10::DeviceIndex count = [] {
    const int machine = machine_device_count();
    const char* visible = std::getenv("FAKEACCEL_VISIBLE_DEVICES");
    if (visible == nullptr) {
      return static_cast<c10::DeviceIndex>(machine);
    }
    int listed = 0;
    std::stringstream entries(visible);
    std::string entry;
    while (std::getline(entries, entry, ',')) {
      if (entry.empty()) {
        continue;
      }
      const int index = std::atoi(entry.c_str());
      TORCH_CHECK(index >= 0 && index < machine, "FAKEACCEL_VISIBLE_DEVICES names device ",
                  entry, ", but the machine has ", machine, " (FAKEACCEL_DEVICE_COUNT)");
      ++listed;
    }
    return static_cast<c10::DeviceIndex>(listed);
  }();
  return count;
}

thread_local c10::DeviceIndex current_device = 0;
// Each device's current stream, per thread, as CUDA's are.
thread_local std::array<c10::StreamId, kMaxDevices> current_streams{};

c10::Stream current_stream(c10::DeviceIndex device) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDeviceType, device),
                     current_streams[device]);
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < visible_device_count(), "fakeaccel:", int(index),
              " does not exist: ", int(visible_device_count()), " device(s) are visible");
}

c10::Device with_index(c10::Device device) {
  return device.has_index() ? device : c10::Device(kDeviceType, current_device);
}

c10::Device resolve(std::optional<c10::Device> device) {
  c10::Device chosen = device.value_or(c10::Device(kDeviceType, current_device));
  if (!chosen.has_index()) {
    chosen = c10::Device(kDeviceType, current_device);
  }
  return chosen;
}

// --- memory ---------------------------------------------------------------------------------

struct Allocation {
  void* ptr;
  size_t bytes;
  c10::DeviceIndex device;
};

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    const c10::DeviceIndex device = current_device;
    check_index(device);
    void* ptr = bytes ? c10::alloc_cpu(bytes) : nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& stats = stats_[device];
      for (auto* stat : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                         &stats.requested_bytes}) {
        (*stat)[0].increase(bytes);
      }
      stats.allocation[0].increase(1);
      stats.segment[0].increase(1);
      stats.active[0].increase(1);
      stats.num_device_alloc += 1;
    }
    auto* allocation = new Allocation{ptr, bytes, device};
    checker::allocated(ptr, current_stream(device), bytes);
    return {ptr, allocation, &DeviceMemory::release, c10::Device(kDeviceType, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached: freed memory is returned
  void recordStream(const c10::DataPtr& data, c10::Stream stream) override {
    checker::record_stream(data.get(), stream);
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_[device], [](c10::CachingAllocator::Stat& stat) {
      stat.reset_accumulated();
    });
    stats_[device].num_device_alloc = 0;
    stats_[device].num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_[device], [](c10::CachingAllocator::Stat& stat) { stat.reset_peak(); });
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto used = static_cast<size_t>(stats_[device].allocated_bytes[0].current);
    return {kNominalMemoryBytes - std::min(used, kNominalMemoryBytes), kNominalMemoryBytes};
  }

 private:
  template <typename Fn>
  static void for_each_stat(c10::CachingDeviceAllocator::DeviceStats& stats, Fn fn) {
    for (auto* array : {&stats.allocation, &stats.segment, &stats.active,
                        &stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
      for (auto& stat : *array) {
        fn(stat);
      }
    }
  }

  static void release(void* context) {
    auto* allocation = static_cast<Allocation*>(context);
    try {
      checker::freed(allocation->ptr);
    } catch (...) {  // a deleter must not throw; a lost finding beats a terminate
    }
    instance().forget(*allocation);
    if (allocation->ptr != nullptr) {
      c10::free_cpu(allocation->ptr);
    }
    delete allocation;
  }

  void forget(const Allocation& allocation) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& stats = stats_[allocation.device];
    for (auto* stat : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                       &stats.requested_bytes}) {
      (*stat)[0].decrease(allocation.bytes);
    }
    stats.allocation[0].decrease(1);
    stats.segment[0].decrease(1);
    stats.active[0].decrease(1);
    stats.num_device_free += 1;
  }

 public:
  static DeviceMemory& instance() {
    static DeviceMemory* memory = new DeviceMemory();  // never destroyed: frees may come late
    return *memory;
  }

 private:
  std::mutex mutex_;
  std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> stats_{};
};

// Host memory "pinned" for this device: ordinary memory, remembered so is_pinned() is true.
class PinnedMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* ptr = bytes ? c10::alloc_cpu(bytes) : nullptr;
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      pinned_.insert(ptr);
    }
    return {ptr, ptr, &PinnedMemory::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &PinnedMemory::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pinned_.count(ptr) > 0;
  }

  static PinnedMemory& instance() {
    static PinnedMemory* memory = new PinnedMemory();
    return *memory;
  }

 private:
  static void release(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(instance().mutex_);
      instance().pinned_.erase(ptr);
    }
    c10::free_cpu(ptr);
  }

  std::mutex mutex_;
  std::unordered_set<const void*> pinned_;
};

// Replace a storage's memory with `bytes` of fresh device memory, keeping what fits.
void resize_storage_bytes(const c10::Storage& storage, size_t bytes) {
  auto* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "this fakeaccel storage is not resizable");
  c10::DeviceGuard guard(impl->device());
  c10::DataPtr fresh = DeviceMemory::instance().allocate(bytes);
  const size_t kept = std::min(bytes, impl->nbytes());
  if (kept > 0) {
    checker::kernel("aten::resize_", current_stream(impl->device().index()),
                    {impl->data_ptr().get()}, {fresh.get()});
    std::memcpy(fresh.get(), impl->data(), kept);
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(bytes);
}

// --- streams and events ----------------------------------------------------------------------

std::atomic<c10::StreamId> next_stream_id{kStreamPoolSize + 1};
std::atomic<uint32_t> next_pool_stream{0};

struct Event {
  c10::DeviceIndex device = 0;
  c10::StreamId stream = 0;
  int64_t records = 0;
  std::chrono::steady_clock::time_point when;
};

struct EventWait {
  int64_t device;
  int64_t stream;
  int64_t event;
  int64_t records;
};

std::mutex waits_mutex;
std::vector<EventWait> waits;

class Guard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kDeviceType; }

  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device previous = getDevice();
    if (device.index() != previous.index()) {
      setDevice(device);
    }
    return previous;
  }

  c10::Device getDevice() const override { return c10::Device(kDeviceType, current_device); }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDeviceType, "expected a fakeaccel device, got ", device);
    check_index(device.index());
    current_device = device.index();
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    current_device = device.index();
  }

  c10::Stream getStream(c10::Device device) const override {
    device = with_index(device);
    return c10::Stream(c10::Stream::UNSAFE, device, current_streams[device.index()]);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::UNSAFE, with_index(device), 0);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    const auto id = 1 + static_cast<c10::StreamId>(next_pool_stream++ % kStreamPoolSize);
    return c10::Stream(c10::Stream::UNSAFE, with_index(device), id);
  }

  c10::Stream getNewStream(c10::Device device, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, with_index(device), next_stream_id++);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    auto& slot = current_streams[stream.device_index()];
    const c10::Stream previous(c10::Stream::UNSAFE, stream.device(), slot);
    slot = stream.id();
    return previous;
  }

  c10::DeviceIndex deviceCount() const noexcept override { return visible_device_count(); }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "an event of fakeaccel:", int(device_index), " recorded on a stream of ",
                stream.device());
    auto* recorded = static_cast<Event*>(*event);
    if (recorded == nullptr) {
      recorded = new Event();
      *event = recorded;
    }
    recorded->device = stream.device_index();
    recorded->stream = stream.id();
    recorded->records += 1;
    recorded->when = std::chrono::steady_clock::now();
    checker::event_recorded(recorded, stream);
  }

  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;  // never recorded: nothing to wait for, as on CUDA
    }
    const auto* waited = static_cast<const Event*>(event);
    checker::event_waited(event, stream);
    std::lock_guard<std::mutex> lock(waits_mutex);
    waits.push_back({stream.device_index(), stream.id(), reinterpret_cast<int64_t>(event),
                     waited->records});
  }

  bool queryEvent(void*) const override { return true; }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    try {
      checker::event_destroyed(event);
    } catch (...) {
    }
    delete static_cast<Event*>(event);
  }

  bool queryStream(const c10::Stream&) const override { return true; }
  // Nothing to wait for (work is done when issued); what the wait orders, the checker keeps.
  void synchronizeStream(const c10::Stream& stream) const override {
    checker::stream_synchronized(stream);
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      checker::event_synchronized(event);
    }
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override {
    checker::device_synchronized(device < 0 ? current_device : device);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    checker::record_stream(data.get(), stream);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "both events must be recorded before elapsed_time");
    const auto* first = static_cast<const Event*>(start);
    const auto* second = static_cast<const Event*>(end);
    return std::chrono::duration<double, std::milli>(second->when - first->when).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// --- the hooks torch asks of a PrivateUse1 device ------------------------------------------------

class Hooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return visible_device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return visible_device_count(); }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_index(device);
    current_device = device;
  }

  c10::DeviceIndex getCurrentDevice() const override { return current_device; }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex previous = current_device;
    setCurrentDevice(device);
    return previous;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  // Random numbers come from the CPU's generator: every op runs on the CPU anyway.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }

  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }

  at::Device getDeviceFromPtr(void*) const override {
    return c10::Device(kDeviceType, current_device);
  }

  bool isPinnedPtr(const void* data) const override {
    return PinnedMemory::instance().contains(data);
  }

  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedMemory::instance(); }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    resize_storage_bytes(storage, bytes);
  }
};

struct Registration {
  Registration() {
    c10::SetAllocator(kDeviceType, &DeviceMemory::instance());
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  }
};
const Registration registration;

// --- what a kernel reads and writes, for the stream checker -----------------------------------

// The storage a device tensor's data lives in, as the checker names it (its allocation's
// base), or nullptr for a tensor elsewhere or without bytes.
const void* storage_base(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.device().type() != kDeviceType || !tensor.has_storage()) {
    return nullptr;
  }
  return tensor.storage().data_ptr().get();
}

bool holds_device_tensor(const c10::IValue& value) {
  if (value.isTensor()) {
    return value.toTensor().defined() && value.toTensor().device().type() == kDeviceType;
  }
  if (value.isList()) {
    const auto list = value.toListRef();
    return std::any_of(list.begin(), list.end(), holds_device_tensor);
  }
  return false;
}

struct KernelAccesses {
  std::vector<const void*> reads;
  std::vector<const void*> writes;
  std::optional<c10::DeviceIndex> device;

  void add(const at::Tensor& tensor, bool write) {
    const void* base = storage_base(tensor);
    if (base == nullptr) {
      return;
    }
    (write ? writes : reads).push_back(base);
    if (!device) {
      device = tensor.device().index();
    }
  }

  void add(const c10::IValue& value, bool write) {
    if (value.isTensor()) {
      add(value.toTensor(), write);
    } else if (value.isList()) {
      for (const auto& element : value.toListRef()) {
        add(element, write);
      }
    }
  }

  // One kernel on the current stream of the tensors' device.
  void record(const std::string& op) const {
    if (device) {
      checker::kernel(op, current_stream(*device), reads, writes);
    }
  }
};

// A copy between host and device that is not non_blocking returns when the data has arrived,
// as CUDA's does: the host has then synchronised with the stream.
void record_copy(const at::Tensor& source, const at::Tensor& target, bool non_blocking) {
  if (!checker::enabled()) {
    return;
  }
  KernelAccesses accesses;
  accesses.add(source, false);
  accesses.add(target, true);
  accesses.record("aten::copy_");
  const bool with_host =
      source.device().type() != kDeviceType || target.device().type() != kDeviceType;
  if (accesses.device && with_host && !non_blocking) {
    checker::stream_synchronized(current_stream(*accesses.device));
  }
}

// --- native kernels ---------------------------------------------------------------------------

constexpr c10::DispatchKeySet kKeys{c10::DispatchKey::PrivateUse1};

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  const c10::Device target = resolve(device);
  c10::DeviceGuard guard(target);
  return at::detail::empty_generic(size, &DeviceMemory::instance(), kKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  const c10::Device target = resolve(device);
  c10::DeviceGuard guard(target);
  return at::detail::empty_strided_generic(size, stride, &DeviceMemory::instance(), kKeys,
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over a fakeaccel tensor's bytes (device memory is host memory), so that the
// CPU's own kernels do the copying, strides and dtype conversion included.
at::Tensor host_view(const at::Tensor& tensor) {
  if (tensor.device().type() != kDeviceType) {
    return tensor;
  }
  return at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.strides(), [](void*) {},
                       tensor.options().device(c10::DeviceType::CPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (dst.numel() == 0) {
    return dst;
  }
  record_copy(self, dst, non_blocking);
  host_view(dst).copy_(host_view(self));
  return dst;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  const bool restride =
      memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve;
  if (self.sizes() == size && !restride) {
    return self;  // a view keeps its strides: resizing to its own shape changes nothing
  }
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  const size_t needed =
      (static_cast<size_t>(impl->storage_offset()) + static_cast<size_t>(impl->numel())) *
      self.dtype().itemsize();
  if (impl->numel() > 0 && needed > impl->storage().nbytes()) {
    resize_storage_bytes(impl->storage(), needed);
  }
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  size_t extent = 0;  // bytes from the storage's start to one past the last element
  if (impl->numel() > 0) {
    int64_t last = offset;
    for (size_t dim = 0; dim < size.size(); ++dim) {
      last += (size[dim] - 1) * impl->strides()[dim];
    }
    extent = static_cast<size_t>(last + 1) * self.dtype().itemsize();
  }
  if (extent > impl->storage().nbytes()) {
    resize_storage_bytes(impl->storage(), extent);
  }
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  return set_storage(self, std::move(source), offset, size, stride);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const auto elements = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {elements}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) {
    return self;
  }
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &DeviceMemory::instance(),
                       /*resizable=*/true);
  return set_storage(self, std::move(storage), 0, {0}, {});
}

// Backends other than the CPU's and CUDA's reach convolutions through these two "overrideable"
// operators, which the CPU does not implement: run the CPU's convolution on copies.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    c10::IntArrayRef stride, c10::IntArrayRef padding,
                                    c10::IntArrayRef dilation, bool transposed,
                                    c10::IntArrayRef output_padding, int64_t groups) {
  KernelAccesses accesses;
  accesses.add(input, false);
  accesses.add(weight, false);
  at::Tensor result;
  {
    checker::Pause pause;  // the copies are this kernel's own work
    std::optional<at::Tensor> host_bias;
    if (bias.has_value() && bias->defined()) {
      accesses.add(*bias, false);
      host_bias = bias->cpu();
    }
    result = at::convolution(input.cpu(), weight.cpu(), host_bias, stride, padding, dilation,
                             transposed, output_padding, groups)
                 .to(input.device());
  }
  accesses.add(result, true);
  accesses.record("aten::convolution_overrideable");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  const int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  const std::vector<int64_t> bias_sizes{out_channels};
  KernelAccesses accesses;
  for (const auto* read : {&grad_output, &input, &weight}) {
    accesses.add(*read, false);
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> grads;
  {
    checker::Pause pause;
    auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
        grad_output.cpu(), input.cpu(), weight.cpu(), bias_sizes, stride, padding, dilation,
        transposed, output_padding, groups, output_mask);
    const auto back = [&](const at::Tensor& host) {
      return host.defined() ? host.to(input.device()) : host;
    };
    grads = {back(grad_input), back(grad_weight), back(grad_bias)};
  }
  for (const auto* written : {&std::get<0>(grads), &std::get<1>(grads), &std::get<2>(grads)}) {
    accesses.add(*written, true);
  }
  accesses.record("aten::convolution_backward_overrideable");
  return grads;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!checker::enabled()) {
    at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
    return;
  }
  // What the kernel reads and writes, from its schema: an argument marked (a!) is written.
  const auto& schema = op.schema();
  KernelAccesses accesses;
  const auto& arguments = schema.arguments();
  const auto inputs = torch::jit::last(*stack, arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    accesses.add(inputs[i], alias != nullptr && alias->isWrite());
  }
  {
    checker::Pause pause;  // its copies to and from the CPU are this one kernel's work
    at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
  }
  const auto outputs = torch::jit::last(*stack, schema.returns().size());
  bool device_output = false;
  for (const auto& output : outputs) {
    accesses.add(output, true);
    device_output = device_output || holds_device_tensor(output);
  }
  std::string name = schema.name();
  if (!schema.overload_name().empty()) {
    name += "." + schema.overload_name();
  }
  accesses.record(name);
  // A result that comes back to the host (.item(), a bool) waited for the stream, as on CUDA.
  if (accesses.device && !outputs.empty() && !device_output) {
    checker::stream_synchronized(current_stream(*accesses.device));
  }
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  checker::record_stream(storage_base(self), stream);
}

int64_t device_count() { return visible_device_count(); }

bool stream_check(bool on) { return checker::set_enabled(on); }

std::vector<std::string> take_stream_findings() { return checker::take_findings(); }

void pause_stream_check(bool pause) {
  if (pause) {
    checker::Pause::push();
  } else {
    checker::Pause::pop();
  }
}

// A kernel the caller does itself (a backend's collective), on the current stream.
void record_kernel(const std::string& op, const std::vector<at::Tensor>& reads,
                   const std::vector<at::Tensor>& writes) {
  KernelAccesses accesses;
  for (const auto& tensor : reads) {
    accesses.add(tensor, false);
  }
  for (const auto& tensor : writes) {
    accesses.add(tensor, true);
  }
  accesses.record(op);
}

at::Tensor take_event_waits() {
  std::vector<EventWait> taken;
  {
    std::lock_guard<std::mutex> lock(waits_mutex);
    taken.swap(waits);
  }
  auto table = at::empty({static_cast<int64_t>(taken.size()), 4}, at::kLong);
  auto rows = table.accessor<int64_t, 2>();
  for (size_t i = 0; i < taken.size(); ++i) {
    rows[i][0] = taken[i].device;
    rows[i][1] = taken[i].stream;
    rows[i][2] = taken[i].event;
    rows[i][3] = taken[i].records;
  }
  return table;
}

}  // namespace
}  // namespace fakeaccel

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(fakeaccel::empty_memory_format));
  m.impl("empty_strided", TORCH_FN(fakeaccel::empty_strided));
  m.impl("_copy_from", TORCH_FN(fakeaccel::copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(fakeaccel::copy_from_and_resize));
  m.impl("resize_", TORCH_FN(fakeaccel::resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(fakeaccel::set_source_storage_offset));
  m.impl("set_.source_Storage", TORCH_FN(fakeaccel::set_source_storage));
  m.impl("set_.source_Tensor", TORCH_FN(fakeaccel::set_source_tensor));
  m.impl("set_", TORCH_FN(fakeaccel::set_empty));
  // Views must share their base's memory: the CPU fallback cannot give them that.
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("convolution_overrideable", TORCH_FN(fakeaccel::convolution_overrideable));
  m.impl("convolution_backward_overrideable",
         TORCH_FN(fakeaccel::convolution_backward_overrideable));
  m.impl("record_stream", TORCH_FN(fakeaccel::record_stream));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fakeaccel::cpu_fallback>());
}

TORCH_LIBRARY(fakeaccel, m) {
  m.def("device_count() -> int", &fakeaccel::device_count);
  // Each row: device, stream id, event (its id, as torch.Event.event_id), times recorded.
  m.def("take_event_waits() -> Tensor", &fakeaccel::take_event_waits);
  // The stream checker (stream_checker.h): on or off (from a clean state either way; returns
  // whether it was on), its findings as JSON documents, a pause of this thread's recording
  // (True pauses, False resumes), and a kernel recorded by hand.
  m.def("stream_check(bool on) -> bool", &fakeaccel::stream_check);
  m.def("take_stream_findings() -> str[]", &fakeaccel::take_stream_findings);
  m.def("pause_stream_check(bool pause) -> ()", &fakeaccel::pause_stream_check);
  m.def("record_kernel(str op, Tensor[] reads, Tensor[] writes) -> ()", &fakeaccel::record_kernel);
}
