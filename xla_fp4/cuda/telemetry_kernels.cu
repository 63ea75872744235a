// The telemetry targets on CUDA (ffi_targets.h; the host side is telemetry_sink.h). None synchronizes the stream:
// - xla_fp4_telemetry_step decides on the host, when XLA enqueues it (telemetry_sink.h Sink::Step), and writes the
//   step (or -1) to the device with a one-thread kernel;
// - xla_fp4_telemetry_record, in a recorded step only, copies the statistics into pinned host memory and hands them
//   to the sink from a host function queued behind the copy. Only XLA_FP4_STRICT=1 (`strict_row` >= 0) waits for the
//   copy, to fail the step;
// - xla_fp4_output_stats counts a GEMM output's zeros, on the device, when the step (read there) is recorded.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cuda/block_kernel.cuh"
#include "xla_fp4/cuda/cuda_handlers.h"
#include "xla_fp4/cuda/cuda_util.h"
#include "xla_fp4/ffi_targets.h"
#include "xla_fp4/telemetry_sink.h"

namespace xla_fp4::cuda {
namespace {

using telemetry::Sink;

__global__ void SetKernel(int32_t value, int32_t* out) { *out = value; }

ffi::Error TelemetryStep(cudaStream_t stream, int32_t device, ffi::ResultBuffer<ffi::S32> step, int64_t module,
                         int64_t site, int64_t every, int64_t calls) {
  SetKernel<<<1, 1, 0, stream>>>(Sink::Get().Step(module, site, device, every, calls), step->typed_data());
  return LaunchStatus("telemetry step");
}

// (exact zeros, elements, 0, ...) of y (xla_fp4_output_stats); the zeros are counted only when *step >= 0.
template <typename T>
__global__ void CountZerosKernel(const T* y, int64_t n, const int32_t* step, unsigned long long* zeros) {
  if (*step < 0) return;
  unsigned long long z = 0;
  for (int64_t i = ThreadIndex(); i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) z += ToFloat(y[i]) == 0.0f;
  // One atomic per warp, and none for a warp that counted no zero (all threads add to one address).
  const cooperative_groups::coalesced_group lanes = cooperative_groups::coalesced_threads();
  z = cooperative_groups::reduce(lanes, z, cooperative_groups::plus<unsigned long long>());
  if (lanes.thread_rank() == 0 && z != 0) atomicAdd(zeros, z);
}

__global__ void OutputRowKernel(const unsigned long long* zeros, const int32_t* step, float elements, float* row) {
  for (int i = 0; i < telemetry::kNumFields; ++i) row[i] = 0.0f;
  if (*step < 0) return;
  row[0] = static_cast<float>(*zeros);
  row[1] = elements;
}

ffi::Error OutputStats(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::S32> step, ffi::ResultBuffer<ffi::F32> row) {
  XLA_FP4_RETURN_IF_ERROR(CheckStatsRow(row->element_count(), ffi::F32, "xla_fp4_output_stats"));
  std::optional<void*> word = scratch.Allocate(sizeof(unsigned long long), alignof(unsigned long long));
  if (!word.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "no scratch memory for 8 bytes");
  auto* zeros = static_cast<unsigned long long*>(*word);
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(zeros, 0, sizeof(*zeros), stream), "cudaMemsetAsync"));
  const int64_t n = static_cast<int64_t>(y.element_count());
  return DispatchFloat(y.element_type(), "y", [&](auto tag) {
    using T = decltype(tag);
    if (n > 0) {
      const unsigned blocks = GridSize(n) < 1024u ? GridSize(n) : 1024u;
      CountZerosKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(static_cast<const T*>(y.untyped_data()), n,
                                                                step.typed_data(), zeros);
      XLA_FP4_RETURN_IF_ERROR(LaunchStatus("xla_fp4_output_stats kernel"));
    }
    OutputRowKernel<<<1, 1, 0, stream>>>(zeros, step.typed_data(), static_cast<float>(n), row->typed_data());
    return LaunchStatus("xla_fp4_output_stats row kernel");
  });
}

// A pinned staging buffer for one record: the statistics, then step and block.
struct Staging {
  float* host = nullptr;
  size_t floats = 0;
  int64_t devices = 1;  // a partitioned program's gathered per-device tables (telemetry::CombineDevices)
  int64_t parts = 1;    // a partitioned program's parts, one per device (Sink::AddPart)
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

// The record a staging buffer holds, once its copies are done: the statistics (gathered devices' tables added up),
// step and block.
telemetry::Record Unstaged(const Staging* s) {
  telemetry::Record record = s->record;
  const size_t n = record.values.size();
  record.values = telemetry::CombineDevices(s->host, s->devices,
                                            static_cast<int64_t>(n) / s->devices / telemetry::kNumFields);
  std::memcpy(&record.step, s->host + n, sizeof(int32_t));
  std::memcpy(&record.block, s->host + n + 1, sizeof(int32_t));
  return record;
}

void Release(Staging* s) {
  std::lock_guard<std::mutex> lock(pool_mu);
  pool.push_back(s);
}

void Deliver(void* data) {  // a host function: no CUDA calls
  auto* s = static_cast<Staging*>(data);
  telemetry::Record record = Unstaged(s);
  if (record.step >= 0) Sink::Get().Put(std::move(record), s->parts);  // -1: a kept iteration of a recorded step
  Release(s);
}

ffi::Error TelemetryRecord(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::F32> stats,
                           ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> block, ffi::ResultBuffer<ffi::S32> done,
                           int64_t module, int64_t site, int64_t strict_row, int64_t parts) {
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(done->typed_data(), step.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToDevice, stream),
      "copy"));
  // The step call of this GEMM decided on the host, when XLA enqueued it: a step that is not recorded costs nothing.
  if (Sink::Get().LastStep(module, site, device) < 0) return ffi::Error::Success();
  const size_t n = stats.element_count();
  Staging* s = nullptr;
  XLA_FP4_RETURN_IF_ERROR(Acquire(n + 2, &s));
  s->record = telemetry::Record{module, site, -1, -1, device, std::vector<float>(n)};
  s->devices = stats.dimensions().size() == 3 ? stats.dimensions()[0] : 1;
  s->parts = parts;
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host, stats.typed_data(), n * sizeof(float), cudaMemcpyDeviceToHost, stream), "copy"));
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host + n, step.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "copy"));
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(s->host + n + 1, block.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream), "copy"));
  if (strict_row < 0) return CudaStatus(cudaLaunchHostFunc(stream, Deliver, s), "telemetry host function");
  XLA_FP4_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "telemetry (strict) synchronize"));
  telemetry::Record record = Unstaged(s);
  Release(s);
  // With parts, this device's part: the last one in checks the whole.
  std::optional<telemetry::Record> whole;
  if (record.step >= 0) whole = Sink::Get().Put(std::move(record), parts);
  const std::string message = whole.has_value() ? telemetry::AllZeroMessage(*whole, strict_row) : "";
  if (!message.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xla_fp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryStepCuda, xla_fp4::cuda::TelemetryStep,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4OutputStatsCuda, xla_fp4::cuda::OutputStats,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // y: a GEMM's output
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // (zeros, elements, 0, ...)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_NO_ATTRIBUTES));
