// One step of a route as the engine runs it, for the routes' multi-process tests: the bucket's
// buffer goes to encode and comes back to decode (route.h), and the step is settled as a
// whole step of one bucket (kept when the mean is finite).
#pragma once

#include <cstddef>
#include <vector>

#include "route/frames.h"
#include "route/route.h"

namespace gradcomp::testing {

inline std::vector<float> run_route_step(Route& route, const std::vector<float>& grad,
                                         const StepState& s, size_t bucket,
                                         Milliseconds timeout) {
  const Phases p(bucket, timeout, nullptr);
  std::vector<float> buffer = grad;
  route.encode(buffer, s, p);
  route.exchange(s, p);
  route.decode(buffer, s, p);
  route.settle(route::all_finite(buffer), s);
  return buffer;
}

}  // namespace gradcomp::testing
