// Writes a seed corpus for frame_fuzz: valid frames of every fuzzed codec, a few sizes each, and
// for each codec the same frame with header flags and aux it never writes (resealed by the
// fuzzer, byte 1 bit 0), so every decoder's header checks are reached from the start.
// Usage: frame_fuzz_seeds DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>
#include <vector>
#include <string>

#include "fuzz_codecs.h"
#include "fuzz_input.h"
#include "gradcomp/codec.h"
#include "gradcomp/frame.h"
#include "gradcomp/random.h"

namespace {

// One seed: the codec index, the mode byte (fuzz_codecs.h), the frame.
void write_seed(const std::string& path, char codec, char mode, const std::vector<std::byte>& frame) {
  std::ofstream out(path, std::ios::binary);
  const char prefix[2] = {codec, mode};
  out.write(prefix, 2);
  out.write(reinterpret_cast<const char*>(frame.data()), static_cast<std::streamsize>(frame.size()));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gradcomp;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  std::filesystem::create_directories(argv[1]);
  const auto& specs = fuzz::fuzz_specs();
  for (size_t c = 0; c < specs.size(); ++c) {
    for (size_t n : {0, 1, 5, 64, 300}) {
      auto codec = make_codec(specs[c]);
      std::vector<float> x(n);
      const CounterRng rng(5, c, n, 0);
      for (size_t i = 0; i < n; ++i) x[i] = rng.uniform(static_cast<uint32_t>(i)) - 0.5f;
      const Context ctx{.seed = 1, .world_size = 4};
      const auto frame = fuzz::encode_step(*codec, x, ctx);
      const std::string name = std::string(argv[1]) + "/" + std::to_string(c) + "_" + std::to_string(n);
      write_seed(name, static_cast<char>(c), 0, frame);
      if (n != 64) continue;
      const FrameHeader h = read_frame_header(frame);
      const std::pair<uint8_t, uint32_t> forged[] = {
          {h.flags | 0x02, h.aux}, {h.flags ^ kFlagNonFinite, h.aux}, {h.flags, h.aux ^ 0x5}};
      for (size_t v = 0; v < std::size(forged); ++v) {
        FrameHeader g = h;
        g.flags = forged[v].first;
        g.aux = forged[v].second;
        auto f = frame;
        write_frame_header(g, f);
        write_seed(name + "_header" + std::to_string(v), static_cast<char>(c), 1, f);
      }
    }
  }
  return 0;
}
