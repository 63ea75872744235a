// What a Python extension exports of its telemetry sink (telemetry_sink.h): `telemetry_drain()` and
// `telemetry_label(module, site, text)`. One definition for the CPU (extension.cc) and the CUDA (cuda/bindings.cc)
// modules, each of which has its own sink.
#ifndef XLA_FP4_TELEMETRY_BINDINGS_H_
#define XLA_FP4_TELEMETRY_BINDINGS_H_

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "xla_fp4/telemetry_sink.h"

namespace xla_fp4::telemetry {

inline void DefineBindings(nanobind::module_& m) {
  m.def("telemetry_drain", [] {
    nanobind::list out;
    for (const Record& r : Sink::Get().Drain()) {
      nanobind::list values;
      for (float v : r.values) values.append(v);
      out.append(nanobind::make_tuple(r.module, r.site, r.block, r.step, r.device, values));
    }
    return out;
  }, "The records since the last drain: (module, site, block, step, device, [statistics, row by row]).");
  m.def("telemetry_label", [](int64_t module, int64_t site, std::string label) {
    Sink::Get().SetLabel(module, site, std::move(label));
  }, "Name GEMM `site` of `module` in strict-mode errors.");
  m.attr("TELEMETRY_FIELDS") = static_cast<int>(kNumFields);
}

}  // namespace xla_fp4::telemetry

#endif  // XLA_FP4_TELEMETRY_BINDINGS_H_
