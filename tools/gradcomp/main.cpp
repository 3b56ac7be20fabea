// The gradcomp command: `gradcomp bench codecs`, `gradcomp codecs`.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"

int main(int argc, char** argv) {
  CLI::App app{"gradcomp: compressed gradient communication for data-parallel training"};
  app.require_subcommand(1);
  auto* list = app.add_subcommand("codecs", "List the codecs and their canonical specs");
  list->callback([] {
    for (const auto& name : gradcomp::codec_names()) fmt::print("{}\n", name);
  });
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const gradcomp::Error& e) {
    fmt::print(stderr, "gradcomp: {}\n", e.what());
    return 1;
  }
  return 0;
}
