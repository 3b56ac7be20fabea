#include "bench_routes.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradcomp/codec.h"
#include "gradcomp/engine.h"
#include "gradcomp/feedback.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"
#include "gradcomp/timeline.h"
#include "gradcomp/option.h"

namespace gradcomp::tools {
namespace {

struct Case {
  std::string codec, feedback, route;
  std::string label() const { return fmt::format("{} | {} | {}", codec, feedback, route); }
};

Case parse_case(const std::string& text) {
  Case c;
  const auto a = text.find('|');
  const auto b = a == std::string::npos ? a : text.find('|', a + 1);
  if (a == std::string::npos || b == std::string::npos) {
    throw Error(fmt::format("bench routes: case '{}' must be 'codec|feedback|route', e.g. "
                            "'topk:ratio=0.01|ef|allgather'",
                            text));
  }
  c.codec = text.substr(0, a);
  c.feedback = text.substr(a + 1, b - a - 1);
  c.route = text.substr(b + 1);
  return c;
}

bool launched() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

// Re-runs this command as W ranks under `gradcomp launch`.
int relaunch(const BenchRoutesOptions& options, const std::string& self_exe) {
  std::vector<std::string> args = {self_exe, "launch", "-n", std::to_string(options.processes),
                                   "--servers", std::to_string(options.servers),
                                   "--", self_exe, "bench", "routes"};
  if (!options.transport.empty()) args.insert(args.end(), {"--transport", options.transport});
  std::vector<std::string> sizes;
  for (int s : options.log2_sizes) sizes.push_back(std::to_string(s));
  args.insert(args.end(), {"--sizes", fmt::format("{}", fmt::join(sizes, ",")), "--repeats",
                           std::to_string(options.repeats), "--buckets",
                           std::to_string(options.buckets), "--local-size",
                           std::to_string(options.local_size)});
  if (!options.cases.empty()) {
    args.insert(args.end(), {"--cases", fmt::format("{}", fmt::join(options.cases, ";"))});
  }
  if (!options.json_path.empty()) args.insert(args.end(), {"--json", options.json_path});
  if (!options.allreduce) args.emplace_back("--no-allreduce");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(self_exe.c_str(), argv.data());
  throw Error(fmt::format("bench routes: could not start {}: {}", self_exe, std::strerror(errno)));
}

// The slowest rank's time of one repetition is what a training step would see.
double slowest(Transport& world, double seconds) {
  float s = static_cast<float>(seconds);
  world.allreduce(std::span<float>(&s, 1), ReduceOp::kMax)->wait(world.timeout());
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `once` `repeats` times after a warm-up, each started together after a barrier;
// `prepare` runs before each, untimed (it stands for the backward pass writing gradients).
template <class P, class F>
std::vector<double> time_repeats(Transport& world, int repeats, P&& prepare, F&& once) {
  prepare();
  once();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    prepare();
    world.barrier()->wait(world.timeout());
    const auto start = Clock::now();
    once();
    times.push_back(slowest(world, std::chrono::duration<double>(Clock::now() - start).count()));
  }
  return times;
}

std::vector<float> gradient(size_t n, int rank) {
  std::vector<float> g(n);
  CounterRng rng(42, 0, 0, static_cast<uint32_t>(rank), 0);
  for (size_t i = 0; i < n; ++i) g[i] = rng.uniform(i) - 0.5f;
  return g;
}

struct Row {
  std::string label;
  size_t elements;
  double seconds, allreduce_seconds;
  double exchange_seconds;  // of `seconds`, the engine's exchange stage (its collectives)
  double cpu_seconds;       // CPU time of the process (every thread) per exchange
  size_t bytes_sent;
};

// CPU time of this process so far, every thread (the engine's stages and the transport's).
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

Row measure(const std::shared_ptr<Transport>& world, const Case& c, size_t n,
            const BenchRoutesOptions& options, double allreduce_seconds) {
  Plan plan;
  Option option;
  option.codec = c.codec;
  option.feedback = c.feedback;
  option.route = c.route;
  const auto count = static_cast<size_t>(options.buckets);
  for (size_t b = 0; b < count; ++b) {
    plan.tensors.push_back({fmt::format("bucket{}", b), n / count + (b < n % count ? 1 : 0)});
    plan.buckets.push_back(Bucket{{b}, option});
  }
  EngineOptions engine_options;
  engine_options.seed = 1;
  engine_options.local_size = options.local_size;
  Engine engine(world, plan, engine_options);
  const auto g = gradient(n, world->rank());
  std::vector<float> work(n);
  std::vector<double> exchanges, cpu;
  const auto times = time_repeats(
      *world, options.repeats, [&] { std::copy(g.begin(), g.end(), work.begin()); }, [&] {
    const double cpu_start = process_cpu_seconds();
    size_t at = 0;
    for (size_t b = 0; b < count; ++b) {
      const size_t size = plan.tensors[b].elements;
      engine.ready(b, std::span(work).subspan(at, size));
      at += size;
    }
    engine.synchronize();
    cpu.push_back(process_cpu_seconds() - cpu_start);
    exchanges.push_back(engine.last_step().exchange_seconds);
  });
  exchanges.erase(exchanges.begin());  // the warm-up
  cpu.erase(cpu.begin());
  for (double& e : exchanges) e = slowest(*world, e);
  for (double& e : cpu) e = slowest(*world, e);
  return Row{c.label(), n, median(times), allreduce_seconds, median(exchanges), median(cpu),
             engine.last_step().bytes_sent};
}

double measure_allreduce(Transport& world, size_t n, int repeats) {
  const std::vector<float> g = gradient(n, world.rank());
  std::vector<float> buffer(n);
  return median(time_repeats(
      world, repeats, [&] { std::copy(g.begin(), g.end(), buffer.begin()); }, [&] {
    world.allreduce(std::span<float>(buffer))->wait(world.timeout());
  }));
}

void print_routes_header(const Transport& world) {
  fmt::print("bench routes: {} ranks over {}; time to exchange one bucket (median of the "
             "slowest rank), next to the transport's allreduce of the same float32 bytes\n",
             world.size(), world.name());
  fmt::print("'ms' is the whole exchange (encode, collectives, decode, write back); 'exchange' "
             "the part spent in collectives; 'cpu' the CPU time of the busiest rank's process "
             "(every thread) per exchange\n");
  fmt::print("{:<56} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>11}\n", "codec | feedback | route",
             "elements", "ms", "exchange", "cpu", "allreduce", "speedup", "sent/rank");
}

nlohmann::json to_json(const Transport& world, const std::vector<Row>& rows, int buckets) {
  nlohmann::json out = {{"transport", world.name()}, {"ranks", world.size()},
                        {"buckets", buckets}, {"rows", {}}};
  for (const Row& r : rows) {
    out["rows"].push_back({{"case", r.label},
                           {"elements", r.elements},
                           {"seconds", r.seconds},
                           {"exchange_seconds", r.exchange_seconds},
                           {"cpu_seconds", r.cpu_seconds},
                           {"allreduce_seconds", r.allreduce_seconds},
                           {"bytes_sent", r.bytes_sent}});
  }
  return out;
}

}  // namespace

std::vector<std::string> default_route_cases() {
  return {"none|none|allreduce",          "fp16|none|allreduce",
          "randomk:ratio=0.01|ef|allreduce", "intq|ef|allreduce",
          "powersgd|ef|allreduce",        "topk:ratio=0.01|ef|allgather",
          "efsignsgd|ef|allgather",       "qsgd|none|allgather",
          "topk:ratio=0.01|ef|twoway",    "efsignsgd|ef|twoway",
          "qsgd|none|twoway",             "fp16|none|hierarchical:inner=allreduce",
          "topk:ratio=0.01|ef|hierarchical:inner=allgather,intra=fp16",
          "fp16|none|sharded:inner=allreduce",
          "topk:ratio=0.01|ef|sharded:inner=allgather,intra=fp16"};
}

namespace {

// Every case, checked before any process starts: a typo is one clear message, not one per rank.
std::vector<Case> checked_cases(const BenchRoutesOptions& options) {
  std::vector<Case> cases;
  for (const auto& text : options.cases.empty() ? default_route_cases() : options.cases) {
    Case c = parse_case(text);
    Option option;
    option.codec = c.codec;
    option.feedback = c.feedback;
    option.route = c.route;
    make_codec(c.codec);
    make_feedback(c.feedback);
    check_route(option);
    cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace

int bench_routes(const BenchRoutesOptions& options, const std::string& self_exe) {
  const std::vector<Case> cases = checked_cases(options);
  if (!launched()) return relaunch(options, self_exe);
  TransportOptions transport_options;
  transport_options.backend = options.transport;
  std::shared_ptr<Transport> world = make_transport(transport_options);
  const bool leader = world->rank() == 0;
  if (leader) print_routes_header(*world);
  std::vector<Row> rows;
  for (int log2 : options.log2_sizes) {
    const size_t n = size_t{1} << log2;
    const double allreduce = options.allreduce ? measure_allreduce(*world, n, options.repeats) : 0;
    if (leader && options.allreduce) {
      fmt::print("{:<56} {:>9} {:>9.2f} {:>9.2f} {:>9} {:>9.2f} {:>8} {:>11}\n",
                 "(transport allreduce)", n, allreduce * 1e3, allreduce * 1e3, "", allreduce * 1e3,
                 "1.00x", fmt::format("{:.3g} MB", n * 4e-6));
    }
    for (const Case& c : cases) {
      rows.push_back(measure(world, c, n, options, allreduce));
      const Row& r = rows.back();
      if (leader) {
        fmt::print("{:<56} {:>9} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>7.2f}x {:>11}\n", r.label,
                   n, r.seconds * 1e3, r.exchange_seconds * 1e3, r.cpu_seconds * 1e3,
                   allreduce * 1e3, allreduce / r.seconds,
                   fmt::format("{:.3g} MB", r.bytes_sent * 1e-6));
        std::fflush(stdout);
      }
    }
  }
  if (leader && !options.json_path.empty()) {
    std::ofstream(options.json_path) << to_json(*world, rows, options.buckets).dump(2) << "\n";
    fmt::print("wrote {}\n", options.json_path);
  }
  world->barrier()->wait(world->timeout());
  return 0;
}

}  // namespace gradcomp::tools
