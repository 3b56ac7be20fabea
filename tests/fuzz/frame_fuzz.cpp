// libFuzzer target: arbitrary bytes decoded by every codec must give a FrameError (or a valid
// decode), never a crash, an out-of-bounds access or undefined behaviour (ASan + UBSan).
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz_codecs.h"
#include "gradcomp/codec.h"
#include "gradcomp/error.h"

namespace {

using namespace gradcomp;

std::vector<std::unique_ptr<Codec>>& codecs() {
  static std::vector<std::unique_ptr<Codec>> all = [] {
    std::vector<std::unique_ptr<Codec>> v;
    for (const auto& s : fuzz::fuzz_specs()) v.push_back(make_codec(s));
    return v;
  }();
  return all;
}

// The element count the decoder is asked for: the header's, when it is small enough.
size_t elements_of(const std::vector<std::byte>& frame) {
  if (frame.size() < kFrameHeaderBytes) return frame.size() % 17;
  uint64_t n;
  std::memcpy(&n, frame.data() + 16, sizeof n);
  return n <= fuzz::kMaxFuzzElements ? n : n % 1024;
}

// Runs valid early rounds for n elements, so a multi-round decoder reaches its payload checks.
void prepare_rounds(Codec& codec, size_t n, const Context& ctx) {
  const std::vector<float> x(n, 0.5f);
  for (int r = 0; r + 1 < codec.traits().rounds; ++r) {
    std::vector<std::byte> f(codec.max_round_bytes(r, n));
    f.resize(codec.encode_round(r, x, f, ctx));
    codec.absorb_round(r, f, ctx);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Codec& codec = *codecs()[data[0] % codecs().size()];
  // Copied by range, not memcpy: for an input of 2 bytes the vector is empty and its data() may
  // be null, and memcpy to or from a null pointer is undefined even for 0 bytes.
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  std::vector<std::byte> frame(bytes + 2, bytes + size);
  if ((data[1] & 1) && frame.size() >= kFrameHeaderBytes) {
    const uint32_t crc = crc32(std::span(frame).first(36));
    std::memcpy(frame.data() + 36, &crc, 4);
  }
  std::vector<float> sum(elements_of(frame), 0.0f);
  const Context ctx{.seed = 1, .world_size = 4};
  try {
    if (codec.traits().rounds > 1 && (data[1] & 2)) {
      codec.absorb_round(0, frame, ctx);
    } else {
      if (codec.traits().rounds > 1) prepare_rounds(codec, sum.size(), ctx);
      codec.decode_accumulate(frame, sum, ctx);
    }
  } catch (const Error&) {
    // Rejected with a clear error: the expected outcome for malformed frames.
  }
  return 0;
}
