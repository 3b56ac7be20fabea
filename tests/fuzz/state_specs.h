// The feedback and codec configurations whose state readers are fuzzed, and the layout of a
// state fuzz input: byte 0 picks the spec (modulo the list's size), the rest is the state.
// Shared by the targets and the seed generator so seeds name the same specs.
#pragma once

#include <string>
#include <vector>

namespace gradcomp::fuzz {

// Every feedback kind, with the options that change its array count or its behaviour.
inline const std::vector<std::string>& feedback_specs() {
  static const std::vector<std::string> specs = {
      "none", "ef", "ef:decay=0.5,lr_correction=true", "dgc", "dgc:momentum=0.5,clip=1,nesterov=true",
      "nesterov", "nesterov:ef=true"};
  return specs;
}

// Codecs with a state reader of their own, and one stateless codec (the base reader: empty only).
inline const std::vector<std::string>& codec_state_specs() {
  static const std::vector<std::string> specs = {
      "powersgd:rank=2", "powersgd:rank=1,cols=8", "powersgd:rank=3,warm_start=false", "signum",
      "signum:momentum=0.5", "topk:ratio=0.1"};
  return specs;
}

// Loaded states longer than this are not stepped through (a step is O(n); the reader is not).
inline constexpr size_t kMaxStepElements = size_t{1} << 14;

}  // namespace gradcomp::fuzz
