#include "single_rank.h"

#include <unistd.h>

#include <filesystem>
#include <string>

namespace gradcomp::testing {

std::shared_ptr<Transport> single_rank_transport() {
  static int instance = 0;
  const auto store = std::filesystem::temp_directory_path() /
                     ("gradcomp_single_rank_" + std::to_string(::getpid())) /
                     std::to_string(instance++);
  std::filesystem::remove_all(store);
  std::filesystem::create_directories(store);
  TransportOptions options;
  options.backend = "gloo";
  options.rank = 0;
  options.world_size = 1;
  options.store = "file:" + store.string();
  options.timeout = Milliseconds(10'000);
  return make_transport(options);
}

}  // namespace gradcomp::testing
