// libFuzzer target: arbitrary text read as a cluster (the JSON syntax, then Cluster::from_json,
// as --cluster FILE does) must give a gradcomp::Error or a cluster; a cluster it accepts must
// pass validate() and be readable again from its own to_json.
#include <nlohmann/json.hpp>

#include "gradcomp/json_text.h"
#include "fuzz_input.h"
#include "gradcomp/model/cluster.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  fuzz::expect_error_or_success([&] {
    const auto cluster = model::Cluster::from_json(parse_json_text(fuzz::as_text(data, size), "cluster"));
    try {
      cluster.validate();
      (void)model::Cluster::from_json(cluster.to_json());
    } catch (const Error&) {
      fuzz::finding("an accepted cluster is invalid or rejected when read back from its own JSON");
    }
  });
  return 0;
}
