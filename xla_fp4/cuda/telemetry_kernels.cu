// The telemetry targets on CUDA (ffi_targets.h; the host side is telemetry_sink.h). Neither synchronizes the stream:
// - xla_fp4_telemetry_step counts on the device, one counter per (module, site, device) and block, because the
//   block index (a scanned stack's iteration) lives on the device;
// - xla_fp4_telemetry_record copies the statistics into pinned host memory and hands them to the sink from a host
//   function queued behind the copy. Only XLA_FP4_STRICT=1 (`strict_row` >= 0) waits for the copy, to fail the step.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/ffi_targets.h"
#include "xla_fp4/telemetry_sink.h"

namespace xla_fp4::cuda {
namespace {

using telemetry::Sink;

constexpr int32_t kMaxBlocks = 4096;  // counters per GEMM: blocks -1 .. kMaxBlocks - 2; later ones share the last

__global__ void StepKernel(const int32_t* block, int64_t* counters, int64_t every, int32_t* step) {
  int32_t slot = *block + 1;
  slot = slot < 0 ? 0 : (slot >= kMaxBlocks ? kMaxBlocks - 1 : slot);
  const int64_t n = counters[slot]++;  // one thread: a GEMM's calls on one device run in stream order
  *step = every > 0 && n % every == 0 ? static_cast<int32_t>(n) : -1;
}

// Device counters, allocated at a GEMM's first call on a device (zeroed in stream order).
int64_t* Counters(cudaStream_t stream, int64_t module, int64_t site, int32_t device, ffi::Error* error) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int32_t>, int64_t*> counters;
  std::lock_guard<std::mutex> lock(mu);
  int64_t*& slot = counters[std::make_tuple(module, site, device)];
  if (slot == nullptr) {
    *error = CudaStatus(cudaMalloc(&slot, kMaxBlocks * sizeof(int64_t)), "telemetry counters");
    if (error->success()) *error = CudaStatus(cudaMemsetAsync(slot, 0, kMaxBlocks * sizeof(int64_t), stream), "memset");
  }
  return slot;
}

ffi::Error TelemetryStep(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> block,
                         ffi::ResultBuffer<ffi::S32> step, int64_t module, int64_t site, int64_t every) {
  ffi::Error error = ffi::Error::Success();
  int64_t* counters = Counters(stream, module, site, device, &error);
  if (error.failure()) return error;
  StepKernel<<<1, 1, 0, stream>>>(block.typed_data(), counters, every, step->typed_data());
  return LaunchStatus("telemetry step");
}

// A pinned staging buffer for one record: the statistics, then step and block.
struct Staging {
  float* host = nullptr;
  size_t floats = 0;
  telemetry::Record record;
};

std::mutex pool_mu;
std::vector<Staging*> pool;  // free staging buffers (host functions may not call CUDA, so they are reused, never freed)

ffi::Error Acquire(size_t floats, Staging** out) {
  {
    std::lock_guard<std::mutex> lock(pool_mu);
    for (size_t i = 0; i < pool.size(); ++i) {
      if (pool[i]->floats >= floats) {
        *out = pool[i];
        pool.erase(pool.begin() + i);
        return ffi::Error::Success();
      }
    }
  }
  auto* s = new Staging;
  s->floats = floats;
  *out = s;
  return CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&s->host), floats * sizeof(float), cudaHostAllocDefault),
                    "telemetry staging");
}

void Deliver(void* data) {  // a host function: no CUDA calls
  auto* s = static_cast<Staging*>(data);
  const size_t n = s->record.values.size();
  std::memcpy(s->record.values.data(), s->host, n * sizeof(float));
  std::memcpy(&s->record.step, s->host + n, sizeof(int32_t));
  std::memcpy(&s->record.block, s->host + n + 1, sizeof(int32_t));
  Sink::Get().Add(s->record);
  std::lock_guard<std::mutex> lock(pool_mu);
  pool.push_back(s);
}

ffi::Error TelemetryRecord(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::F32> stats,
                           ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> block, ffi::ResultBuffer<ffi::S32> done,
                           int64_t module, int64_t site, int64_t strict_row) {
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(done->typed_data(), step.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToDevice, stream),
      "copy"));
  const size_t n = stats.element_count();
  Staging* s = nullptr;
  XLA_FP4_RETURN_IF_ERROR(Acquire(n + 2, &s));
  s->record = telemetry::Record{module, site, -1, -1, device, std::vector<float>(n)};
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host, stats.typed_data(), n * sizeof(float), cudaMemcpyDeviceToHost, stream), "copy"));
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host + n, step.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "copy"));
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host + n + 1, block.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "copy"));
  if (strict_row < 0) return CudaStatus(cudaLaunchHostFunc(stream, Deliver, s), "telemetry host function");
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "telemetry (strict) synchronize"));
  telemetry::Record record = s->record;
  std::memcpy(record.values.data(), s->host, n * sizeof(float));
  record.step = *reinterpret_cast<int32_t*>(s->host + n);
  std::string message = telemetry::AllZeroMessage(record, strict_row);
  Deliver(s);
  if (!message.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xla_fp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryStepCuda, xla_fp4::cuda::TelemetryStep,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // step, or -1
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_STEP_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryRecordCuda, xla_fp4::cuda::TelemetryRecord,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // statistics
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // the step, passed through
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_RECORD_ATTRIBUTES));
