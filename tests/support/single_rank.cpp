#include "single_rank.h"

#include <unistd.h>

#include <filesystem>
#include <string>

namespace gradcomp::testing {

namespace {

// This process's stores, one folder under the temporary directory, removed when the test
// program ends (a rendezvous needs the files only while the transports connect).
struct StoreFolder {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("gradcomp_single_rank_" + std::to_string(::getpid()));
  ~StoreFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

std::shared_ptr<Transport> single_rank_transport() {
  static StoreFolder folder;
  static int instance = 0;
  const auto store = folder.path / std::to_string(instance++);
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
