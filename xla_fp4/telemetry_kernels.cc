// The CPU handlers of the telemetry targets (ffi_targets.h): numbering a GEMM's executions, recording its statistics
// on the host (telemetry_sink.h), and a GEMM output's zeros. None touches the program's values; in a step that is not
// recorded (step -1) each returns at once.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cpu_common.h"
#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/ffi_targets.h"
#include "xla_fp4/telemetry_sink.h"

namespace xla_fp4::cpu {
namespace {

namespace ffi = xla::ffi;
using telemetry::Sink;

ffi::Error TelemetryStep(int32_t device, ffi::ResultBuffer<ffi::S32> step, int64_t module, int64_t site, int64_t every,
                         int64_t calls) {
  step->typed_data()[0] = Sink::Get().Step(module, site, device, every, calls);
  return ffi::Error::Success();
}

ffi::Error TelemetryRecord(int32_t device, ffi::Buffer<ffi::F32> stats, ffi::Buffer<ffi::S32> step,
                           ffi::Buffer<ffi::S32> block, ffi::ResultBuffer<ffi::S32> done, int64_t module, int64_t site,
                           int64_t strict_row, int64_t parts) {
  done->typed_data()[0] = step.typed_data()[0];
  if (step.typed_data()[0] < 0) return ffi::Error::Success();  // not a recorded step
  // [rows, FIELDS], or a partitioned program's [devices, rows, FIELDS] (telemetry::CombineDevices)
  const auto dims = stats.dimensions();
  const int64_t devices = dims.size() == 3 ? dims[0] : 1;
  telemetry::Record record{module, site, block.typed_data()[0], step.typed_data()[0], device,
                           telemetry::CombineDevices(stats.typed_data(), devices,
                                                     static_cast<int64_t>(stats.element_count()) / devices /
                                                         telemetry::kNumFields)};
  // With parts, this device's part: the sink adds the GEMM's parts, and the last one in checks the whole.
  std::optional<telemetry::Record> whole = Sink::Get().Put(std::move(record), parts);
  const std::string error = whole.has_value() ? telemetry::AllZeroMessage(*whole, strict_row) : "";
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, error);
  return ffi::Error::Success();
}

// (exact zeros, elements, 0, ...) of y, a GEMM's output (numerics/telemetry.py output_stats); zeros when step < 0.
template <typename T>
int64_t CountZeros(ffi::ThreadPool& pool, const T* y, int64_t n) {
  std::atomic<int64_t> zeros{0};
  ParallelFor(pool, n, 1, [&](int64_t begin, int64_t end) {
    int64_t z = 0;
    for (int64_t i = begin; i < end; ++i) z += Load(y + i) == 0.0f;
    zeros.fetch_add(z, std::memory_order_relaxed);
  });
  return zeros.load();
}

ffi::Error OutputStats(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> step,
                       ffi::ResultBuffer<ffi::F32> row) {
  if (ffi::Error e = CheckStatsRow(row->element_count(), ffi::DataType::F32, "xla_fp4_output_stats"); e.failure()) {
    return e;
  }
  float* out = row->typed_data();
  std::fill(out, out + telemetry::kNumFields, 0.0f);
  if (step.typed_data()[0] < 0) return ffi::Error::Success();
  const int64_t n = static_cast<int64_t>(y.element_count());
  return DispatchFloat(y.element_type(), "y", [&](auto tag) {
    using T = decltype(tag);
    // A GEMM output's row (numerics/telemetry.py output_zeros): its zeros and elements in the first two fields.
    out[0] = static_cast<float>(CountZeros(pool, static_cast<const T*>(y.untyped_data()), n));
    out[1] = static_cast<float>(n);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryStepCpu, xla_fp4::cpu::TelemetryStep,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // step: this call's, or -1 (not recorded)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_STEP_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryRecordCpu, xla_fp4::cpu::TelemetryRecord,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // statistics: [rows, kNumFields] or
                                                                 // [devices, rows, kNumFields]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block
                                  .Ret<ffi::Buffer<ffi::S32>>()  // the step, passed through
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_RECORD_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4OutputStatsCpu, xla_fp4::cpu::OutputStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // y: a GEMM's output
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step (-1: not recorded)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // (zeros, elements, 0, ...)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_NO_ATTRIBUTES));
