// GpuStreams on HIP: the streams a GPU processor runs task bodies on, and events as markers.
#include "runtime/gpu/platform.h"
#include "runtime/gpu_processor.h"

#include <fmt/format.h>

#include <mutex>
#include <vector>

namespace caravan::detail {
namespace {

FailureCause failure_of(const Error& e) { return std::make_shared<const Error>(e); }

class DeviceStreams final : public GpuStreams {
 public:
  DeviceStreams(int device, int per_class) : device_(device) {
    // Built on whichever thread spawns the first GPU task: its current device is put back.
    const gpu::ScopedDevice on_device(device_);
    int least = 0, greatest = 0;
    CARAVAN_HIP_CHECK(hipDeviceGetStreamPriorityRange(&least, &greatest));
    try {
      for (int i = 0; i < 2 * per_class; ++i) {
        hipStream_t stream = nullptr;
        CARAVAN_HIP_CHECK(hipStreamCreateWithPriority(&stream, hipStreamNonBlocking, i < per_class ? least : greatest));
        streams_.push_back(stream);
      }
    } catch (...) {
      for (hipStream_t s : streams_) (void)hipStreamDestroy(s);
      throw;
    }
  }

  ~DeviceStreams() override {
    for (hipStream_t s : streams_) {
      if (hipStreamSynchronize(s) != hipSuccess) (void)hipGetLastError();
      (void)hipStreamDestroy(s);
    }
    for (hipEvent_t e : free_events_) (void)hipEventDestroy(e);
  }

  int device() const override { return device_; }
  int lane_count() const override { return static_cast<int>(streams_.size()); }
  void bind_thread() override { make_current(); }
  void* stream(int lane) override { return streams_[static_cast<std::size_t>(lane)]; }

  void* record(int lane) override {
    // An event is recorded on a stream of its own device, whichever device is current (the body
    // may have switched); only creating one needs this GPU current.
    hipEvent_t event = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (!free_events_.empty()) {
        event = free_events_.back();
        free_events_.pop_back();
      }
    }
    hipStream_t stream = streams_[static_cast<std::size_t>(lane)];
    // Without a marker the task is reported at once, so first wait here for the work its body
    // enqueued (whoever sees the failure may free what that work uses). Rare: only after errors.
    auto fail = [&](hipError_t status, const char* call) {
      (void)hipGetLastError();
      if (hipStreamSynchronize(stream) != hipSuccess) (void)hipGetLastError();
      gpu::throw_hip_error(status, call, __FILE__, __LINE__);
    };
    if (!event) {
      try {
        make_current();
      } catch (const Error&) {  // the same rule: the body's work ends before the failure is told
        (void)hipGetLastError();
        if (hipStreamSynchronize(stream) != hipSuccess) (void)hipGetLastError();
        throw;
      }
      if (hipError_t status = hipEventCreateWithFlags(&event, hipEventDisableTiming); status != hipSuccess)
        fail(status, "hipEventCreateWithFlags(&event, hipEventDisableTiming)");
    }
    if (hipError_t status = hipEventRecord(event, stream); status != hipSuccess) {
      (void)hipEventDestroy(event);
      fail(status, "hipEventRecord(event, stream)");
    }
    return event;
  }

  FailureCause wait(void* marker) override {
    auto event = static_cast<hipEvent_t>(marker);
    FailureCause failure;
    if (hipError_t status = hipEventSynchronize(event); status != hipSuccess) {
      try {
        gpu::throw_hip_error(status, "hipEventSynchronize(event)", __FILE__, __LINE__);
      } catch (const Error& e) {
        failure = failure_of(e);
      }
    }
    return failure;
  }

  void order_after(int lane, void* marker) override {
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(streams_[static_cast<std::size_t>(lane)], static_cast<hipEvent_t>(marker), 0));
  }

  // A wait enqueued before takes the event's record as it was at that call, so the event can be
  // recorded again for another task at once.
  void release(void* marker) override {
    std::lock_guard lock(mutex_);
    free_events_.push_back(static_cast<hipEvent_t>(marker));
  }

 private:
  // hipSetDevice cost 1.6 us per task even with the device current already (H100, CUDA 13),
  // more than the launch it precedes; asking first cost 0.2-1.4 us on the same machine kind.
  void make_current() {
    int current = -1;
    CARAVAN_HIP_CHECK(hipGetDevice(&current));
    if (current != device_) CARAVAN_HIP_CHECK(hipSetDevice(device_));
  }

  int device_;
  std::vector<hipStream_t> streams_;
  std::mutex mutex_;
  std::vector<hipEvent_t> free_events_;
};

}  // namespace

std::unique_ptr<GpuStreams> make_device_streams(int device, int per_class) {
  return std::make_unique<DeviceStreams>(device, per_class);
}

}  // namespace caravan::detail
