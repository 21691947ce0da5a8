#include "worker/sampling/portable_exp.h"

#include <cstddef>

#include "common/logging.h"
#include "worker/sampling/sampling_math.h"

namespace tandem::worker {

double PortableExp(double x) { return sampling_math::SamplingExp(x); }

void PortableExp(std::span<const double> x, std::span<double> out) {
  CHECK(x.size() == out.size()) << "PortableExp: " << x.size() << " inputs, " << out.size() << " outputs";
  for (size_t i = 0; i < x.size(); ++i) out[i] = sampling_math::SamplingExp(x[i]);
}

}  // namespace tandem::worker
