// Data-parallel training of a small CNN on Fashion-MNIST with libtorch and gradcomp: every
// rank trains on its own shard, and gradcomp::torch::DistributedOptimizer averages the
// (compressed) gradients while backward runs.
//
//   build/bin/gradcomp launch -n 2 -- build/bin/train_fashion_mnist --compression 'powersgd:rank=4|ef'
//   mpirun -np 2 build/bin/train_fashion_mnist --compression fp16
//   build/bin/gradcomp launch -n 2 -- build/bin/train_fashion_mnist --compression auto
//
// Rank 0 prints progress, then the test accuracy, the time, the bytes sent per step and the
// compression ratio; every rank checks that all ranks ended with bit-identical parameters (exit
// status 1 otherwise). --c10d-port runs the exchange over a c10d Gloo process group instead of
// gradcomp's own transport. --compression auto lets the scheduler of docs/auto.md choose and
// change the plan (--auto sets its settings); rank 0 then prints each decision and, at the end,
// the plan kept. docs/cpp.md describes the API and the options.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "gradcomp/scheduler.h"
#include "gradcomp/torch/distributed_optimizer.h"
#include "gradcomp/torch/process_group_transport.h"

namespace {

struct Settings {
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string compression = "none";  // or "auto"
  std::string auto_settings;         // JSON, with --compression auto
  int epochs = 1;
  int batch_size = 64;  // per rank
  double lr = 0.05;
  double momentum = 0.9;
  uint64_t seed = 42;
  std::string timeline;
  int log_every = 100;
  int max_steps = 0;  // 0: whole epochs (a short run for smoke tests otherwise)
  double bucket_mb = 25;
  size_t min_compress_elements = 16384;
  int c10d_port = 0;  // > 0: exchange over a c10d Gloo process group instead
};

// ---- data ----------------------------------------------------------------------------------

std::vector<uint8_t> gunzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (!file) throw std::runtime_error(fmt::format("cannot open {}", path));
  std::vector<uint8_t> out;
  std::vector<uint8_t> chunk(1 << 20);
  int n;
  while ((n = gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()))) > 0) {
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
  }
  int err = Z_OK;
  const std::string message = n < 0 ? gzerror(file, &err) : "";
  gzclose(file);
  if (n < 0) throw std::runtime_error(fmt::format("{}: {}", path, message));
  return out;
}

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// An idx file (the MNIST format): magic 0x0000 08 <dims>, then the big-endian dimensions and the
// unsigned bytes. Returns a uint8 tensor of those dimensions.
torch::Tensor read_idx(const std::string& path, size_t expected_dims) {
  std::vector<uint8_t> bytes = gunzip(path);
  const size_t header = 4 + 4 * expected_dims;
  if (bytes.size() < header || big_endian(bytes.data()) != (0x800u | expected_dims)) {
    throw std::runtime_error(fmt::format("{}: not an idx file of {} dimensions", path,
                                         expected_dims));
  }
  std::vector<int64_t> shape;
  size_t count = 1;
  for (size_t d = 0; d < expected_dims; ++d) {
    shape.push_back(big_endian(bytes.data() + 4 + 4 * d));
    count *= static_cast<size_t>(shape.back());
  }
  if (bytes.size() != header + count) {
    throw std::runtime_error(fmt::format("{}: {} bytes of data, the header says {}", path,
                                         bytes.size() - header, count));
  }
  return torch::from_blob(bytes.data() + header, shape, torch::kUInt8).clone();
}

struct Dataset {
  torch::Tensor images;  // N x 1 x 28 x 28 float, normalized
  torch::Tensor labels;  // N int64
};

Dataset load(const std::string& dir, const std::string& split) {
  torch::Tensor images = read_idx(fmt::format("{}/{}-images-idx3-ubyte.gz", dir, split), 3);
  torch::Tensor labels = read_idx(fmt::format("{}/{}-labels-idx1-ubyte.gz", dir, split), 1);
  if (images.size(0) != labels.size(0)) {
    throw std::runtime_error(fmt::format("{}: {} images but {} labels", split, images.size(0),
                                         labels.size(0)));
  }
  // Fashion-MNIST's pixel mean and standard deviation.
  images = (images.to(torch::kFloat).div_(255.0f).sub_(0.2860f).div_(0.3530f)).unsqueeze(1);
  return {images, labels.to(torch::kLong)};
}

// This rank's samples of one epoch: a permutation shared by all ranks (seeded by the epoch),
// cut into equal shards so every rank runs the same number of steps (a rank with one step
// more would wait forever for the others in the exchange).
torch::Tensor shard(int64_t samples, uint64_t seed, int epoch, int rank, int world) {
  auto generator = at::detail::createCPUGenerator(seed * 1000 + static_cast<uint64_t>(epoch));
  torch::Tensor order = torch::randperm(samples, generator, torch::kLong);
  const int64_t per_rank = samples / world;
  return order.narrow(0, rank * per_rank, per_rank);
}

// ---- model ---------------------------------------------------------------------------------

struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{torch::nn::Conv2dOptions(1, 32, 3).padding(1)};
  torch::nn::Conv2d conv2{torch::nn::Conv2dOptions(32, 64, 3).padding(1)};
  torch::nn::Linear fc1{64 * 7 * 7, 128};
  torch::nn::Linear fc2{128, 10};

  NetImpl() {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 32 x 14 x 14
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 64 x 7 x 7
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }
};
TORCH_MODULE(Net);

// ---- distributed helpers -------------------------------------------------------------------

void wait(const gradcomp::WorkPtr& work, gradcomp::Transport& transport) {
  work->wait(transport.timeout());
}

// Rank 0's initial parameters on every rank (the seed already makes them equal; this makes it
// true whatever the random streams of each build do).
void broadcast_parameters(Net& model, gradcomp::Transport& transport) {
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    auto bytes = std::span(static_cast<std::byte*>(p.data_ptr()), p.numel() * p.element_size());
    wait(transport.broadcast(bytes, 0), transport);
  }
}

std::vector<std::byte> parameter_bytes(Net& model) {
  std::vector<std::byte> out;
  for (const auto& p : model->parameters()) {
    const auto* data = static_cast<const std::byte*>(p.data_ptr());
    out.insert(out.end(), data, data + p.numel() * p.element_size());
  }
  return out;
}

// The ranks whose parameters differ from rank 0's, bit for bit.
std::vector<int> ranks_differing_from_rank0(Net& model, gradcomp::Transport& transport) {
  const std::vector<std::byte> mine = parameter_bytes(model);
  std::vector<std::byte> all(mine.size() * transport.size());
  wait(transport.allgather(mine, all), transport);
  std::vector<int> differing;
  for (int r = 1; r < transport.size(); ++r) {
    if (std::memcmp(all.data(), all.data() + r * mine.size(), mine.size()) != 0) {
      differing.push_back(r);
    }
  }
  return differing;
}

// Sums integers over ranks.
int64_t sum_over_ranks(int64_t value, gradcomp::Transport& transport) {
  std::vector<int32_t> v{static_cast<int32_t>(value)};
  wait(transport.allreduce(std::as_writable_bytes(std::span(v)), gradcomp::DType::kI32,
                           gradcomp::ReduceOp::kSum),
       transport);
  return v[0];
}

// Correct predictions of the whole test set, each rank evaluating its own shard.
double test_accuracy(Net& model, const Dataset& test, gradcomp::Transport& transport) {
  torch::NoGradGuard no_grad;
  model->eval();
  const int64_t n = test.images.size(0);
  const int64_t begin = n * transport.rank() / transport.size();
  const int64_t end = n * (transport.rank() + 1) / transport.size();
  int64_t correct = 0;
  // Batches of 250: convolutions unfold their input, so larger ones only cost memory.
  for (int64_t i = begin; i < end; i += 250) {
    const int64_t len = std::min<int64_t>(250, end - i);
    torch::Tensor logits = model->forward(test.images.narrow(0, i, len));
    correct += logits.argmax(1).eq(test.labels.narrow(0, i, len)).sum().item<int64_t>();
  }
  model->train();
  return static_cast<double>(sum_over_ranks(correct, transport)) / static_cast<double>(n);
}

// The exchange over a c10d Gloo process group, as a program that already has one would run it
// (one host: rank 0 serves the group's TCP store on 127.0.0.1:port).
std::shared_ptr<gradcomp::Transport> c10d_transport(int port, int rank, int world) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0;
  store_options.numWorkers = world;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
  return gradcomp::torch::make_process_group_transport(group);
}

// ---- compression="auto" --------------------------------------------------------------------

// The scheduler's settings from --auto's JSON object (its defaults for what it does not name;
// the candidates default to the options recommended under SGD, the optimizer's own family).
gradcomp::AutoSettings auto_settings(const std::string& text) {
  nlohmann::json given;
  if (!text.empty()) {
    given = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (given.is_discarded()) {
      throw gradcomp::Error(
          fmt::format("--auto is not JSON: {} (a JSON object of settings, "
                      "e.g. '{{\"warmup_steps\": 20}}')",
                      text));
    }
  }
  return gradcomp::AutoSettings::from_json(given);
}

// One line on what the scheduler decided, from its report (AutoScheduler::report).
std::string auto_summary(const nlohmann::json& report) {
  const auto& decisions = report.at("decisions");
  const std::string now =
      fmt::format("at the end ({}, step {}) the plan was {}", report.at("phase").get<std::string>(),
                  report.at("steps").get<uint64_t>(), report.at("plan").get<std::string>());
  if (decisions.empty()) return fmt::format("auto: no decision yet; {}", now);
  const auto& last = decisions.back();
  return fmt::format("auto: {} decision(s), the last keeping '{}' from step {}; {}",
                     decisions.size(), last.at("kept_name").get<std::string>(),
                     last.at("step").get<uint64_t>(), now);
}

// ---- training ------------------------------------------------------------------------------

struct Totals {
  int64_t steps = 0;
  double train_seconds = 0;  // the training steps only, without loading and evaluation
  double bytes_sent = 0;
  double uncompressed_bytes = 0;
  double exchange_seconds = 0;
};

int train(const Settings& s) {
  torch::set_num_threads(1);  // one core per rank: ranks share the machine
  std::shared_ptr<gradcomp::Transport> transport = gradcomp::make_transport();
  const int rank = transport->rank();
  const int world = transport->size();
  auto say = [rank](const std::string& line) {
    if (rank != 0) return;
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);  // progress shows up at once under the launchers' pipes
  };

  const Dataset train_set = load(s.data_dir, "train");
  const Dataset test_set = load(s.data_dir, "t10k");

  torch::manual_seed(s.seed);
  Net model;
  broadcast_parameters(model, *transport);
  torch::optim::SGD sgd(model->parameters(),
                        torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  gradcomp::torch::GradientOptions options;
  if (s.compression == "auto") {
    options.auto_settings = auto_settings(s.auto_settings);
  } else {
    options.compression = gradcomp::torch::parse_compression(s.compression);
  }
  options.bucket_bytes = static_cast<size_t>(s.bucket_mb * (1 << 20));
  options.min_compress_elements = s.min_compress_elements;
  options.engine.seed = s.seed;
  options.engine.timeline = s.timeline;
  // gradcomp's own transport also serves this program's broadcast, evaluation and checks.
  std::shared_ptr<gradcomp::Transport> exchange =
      s.c10d_port > 0 ? c10d_transport(s.c10d_port, rank, world) : transport;
  gradcomp::torch::DistributedOptimizer optimizer(sgd, model->named_parameters(), exchange,
                                                  options);
  say(fmt::format("{} ranks over {}, compression '{}', {} samples per rank and epoch, batch {}",
                  world, exchange->name(), s.compression, train_set.images.size(0) / world,
                  s.batch_size));

  Totals totals;
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    const auto epoch_start = Clock::now();
    torch::Tensor mine = shard(train_set.images.size(0), s.seed, epoch, rank, world);
    const int64_t steps = mine.size(0) / s.batch_size;  // the same on every rank
    for (int64_t step = 0; step < steps; ++step) {
      if (s.max_steps > 0 && totals.steps >= s.max_steps) break;
      torch::Tensor index = mine.narrow(0, step * s.batch_size, s.batch_size);
      optimizer.zero_grad();
      torch::Tensor loss = torch::cross_entropy_loss(
          model->forward(train_set.images.index_select(0, index)),
          train_set.labels.index_select(0, index));
      loss.backward();
      optimizer.step();

      const gradcomp::StepStats& stats = optimizer.gradients().last_step();
      ++totals.steps;
      totals.bytes_sent += static_cast<double>(stats.bytes_sent);
      totals.uncompressed_bytes += static_cast<double>(stats.uncompressed_bytes);
      totals.exchange_seconds += stats.exchange_seconds;
      if (s.log_every > 0 && (step + 1) % s.log_every == 0) {
        say(fmt::format("epoch {} step {}/{}  loss {:.4f} (rank 0)  {:.1f} s", epoch + 1,
                        step + 1, steps, loss.item<float>(),
                        totals.train_seconds + since(epoch_start)));
      }
    }
    totals.train_seconds += since(epoch_start);
    if (s.max_steps > 0 && totals.steps >= s.max_steps) break;
    if (epoch + 1 < s.epochs) {  // the last epoch's accuracy is part of the result line
      say(fmt::format("epoch {}: test accuracy {:.2f}%", epoch + 1,
                      100 * test_accuracy(model, test_set, *transport)));
    }
  }
  const double train_seconds = totals.train_seconds;

  const std::vector<int> differing = ranks_differing_from_rank0(model, *transport);
  const double accuracy = test_accuracy(model, test_set, *transport);
  const double steps = static_cast<double>(std::max<int64_t>(totals.steps, 1));
  say(fmt::format(
      "result: ranks {}  compression '{}'  steps {}  test accuracy {:.2f}%  time {:.1f} s "
      "({:.1f} ms/step, exchange {:.2f} ms/step)  sent {:.0f} B/step of {:.0f} B "
      "uncompressed  ratio {:.1f}x",
      world, s.compression, totals.steps, 100 * accuracy, train_seconds,
      1e3 * train_seconds / steps, 1e3 * totals.exchange_seconds / steps,
      totals.bytes_sent / steps, totals.uncompressed_bytes / steps,
      totals.uncompressed_bytes / std::max(totals.bytes_sent, 1.0)));
  if (!differing.empty()) {
    std::fprintf(stderr, "rank %d: parameters differ from rank 0's on %zu rank(s), first %d\n",
                 rank, differing.size(), differing.front());
    return 1;
  }
  say(fmt::format("parameters identical on all {} ranks", world));
  if (options.auto_settings) say(auto_summary(optimizer.gradients().auto_report()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"Data-parallel Fashion-MNIST training with libtorch and gradcomp"};
  app.add_option("--data-dir", s.data_dir, "Directory of the gzip'd idx files");
  app.add_option("--compression", s.compression,
                 "codec[|feedback[|route]], e.g. none, fp16, 'topk:ratio=0.01|ef', or auto "
                 "(the scheduler chooses)");
  app.add_option("--auto", s.auto_settings,
                 "With --compression auto: its settings, a JSON object, e.g. "
                 "'{\"warmup_steps\": 20, \"candidates\": [\"powersgd:rank=4|ef\"]}'");
  app.add_option("--epochs", s.epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", s.batch_size, "Per rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", s.lr)->check(CLI::PositiveNumber);
  app.add_option("--momentum", s.momentum)->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", s.seed);
  app.add_option("--timeline", s.timeline, "Chrome-trace path ({rank} or .rankN is added)");
  app.add_option("--log-every", s.log_every, "Print progress every N steps (0: never)");
  app.add_option("--max-steps", s.max_steps, "Stop after N steps (0: whole epochs)");
  app.add_option("--bucket-mb", s.bucket_mb, "Fusion bucket size")->check(CLI::PositiveNumber);
  app.add_option("--min-compress-elements", s.min_compress_elements,
                 "Smaller tensors stay uncompressed");
  app.add_option("--c10d-port", s.c10d_port,
                 "Exchange over a c10d Gloo process group whose TCP store rank 0 serves on "
                 "127.0.0.1:PORT (one host), not over gradcomp's own transport");
  CLI11_PARSE(app, argc, argv);
  if (!s.auto_settings.empty() && s.compression != "auto") {
    std::fprintf(stderr,
                 "train_fashion_mnist: --auto sets the scheduler of --compression auto; "
                 "it needs --compression auto\n");
    return 2;
  }
  try {
    return train(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
