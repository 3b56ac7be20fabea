// gradcomp_soak: many small training steps on every rank, with the plan changed and the engine
// checkpointed along the way, watching that resident memory, open files and threads stay flat
// (and reporting resident memory by kind and malloc's figures) and that every rank ends with
// bit-identical parameters (docs/soak.md).
//
//   gradcomp launch -n 4 -- gradcomp_soak --steps 100000 --out soak.json
//   mpirun -np 4 gradcomp_soak --steps 100000              (the MPI transport)
#include <dirent.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "gradcomp/plan.h"
#include "gradcomp/random.h"
#include "gradcomp/transport.h"

namespace gradcomp::soak {
namespace {

using Clock = std::chrono::steady_clock;

// The plans the soak rotates through: every route, summable and gathered codecs, a two-round
// codec, data-dependent frame sizes (dgc), stateless and stateful feedback. qsgd has a norm per
// block of 256: with one norm per bucket its error (about 6x the input's norm at 8k elements)
// is more than error feedback can absorb, and the memory grows without bound.
std::vector<std::string> default_rotation() {
  return {"none",
          "topk:ratio=0.01|ef|allgather",
          "qsgd:block=256|ef",
          "powersgd:rank=2|ef",
          "fp16",
          "topk:ratio=0.01|ef|twoway",
          "dgc:ratio=0.01|dgc|allgather",
          "topk:ratio=0.01|ef|hierarchical:inner=allgather,intra=fp16"};
}

struct Settings {
  uint64_t steps = 100'000;
  // 0: the baseline step over the rotation's length (1,250 of 100,000 steps), so that every
  // plan of the rotation has run before the baseline and the growth after it is what steady
  // use adds, not what the first use of a route costs (docs/soak.md).
  uint64_t plan_every = 0;
  uint64_t checkpoint_every = 2'500;
  uint64_t sample_every = 0;   // 0: steps / 10
  uint64_t baseline_step = 0;  // 0: steps / 10 (step 10,000 of 100,000)
  // Largest growth of resident memory (VmRSS) allowed from the baseline step to the end, in
  // percent of the baseline's. malloc's bytes in use are reported, not checked: glibc counts the
  // freed chunks each thread caches (tcache) as in use, and the caches of threads that live for
  // the whole run fill up to their bound over tens of thousands of steps (docs/soak.md).
  double max_rss_growth = 1.0;
  // Small enough that top-k at 1% with error feedback (a coordinate's update comes about every
  // 100 steps, all at once) and DGC's momentum stay stable on the quadratic below.
  double learning_rate = 0.001;
  uint64_t seed = 1;
  std::vector<std::string> rotation = default_rotation();
  // Plan changes build a new engine (as before Engine::set_plan existed) instead of
  // changing the live engine's plan.
  bool new_engine_per_plan = false;
  std::string checkpoint_dir = "/tmp";
  std::string out;  // JSON report; empty: none
};

// The step the end is compared with: by default a tenth into the run (10,000 of 100,000), after
// the allocator, the transport and the first plans have settled.
uint64_t baseline_step_of(const Settings& s) {
  return s.baseline_step != 0 ? s.baseline_step : std::max<uint64_t>(1, s.steps / 10);
}

uint64_t sample_every_of(const Settings& s) {
  return s.sample_every != 0 ? s.sample_every : std::max<uint64_t>(1, s.steps / 10);
}

// ---- what the process holds -----------------------------------------------------------------

struct Resources {
  int64_t rss_kb = 0;  // VmRSS: the sum of the three below
  // VmRSS split by what backs the pages (/proc/self/status): anonymous memory (the heap, the
  // stacks, private copies), mapped files (code and file-backed mappings) and shared memory
  // (shmem/tmpfs, e.g. an MPI library's shared-memory segments, counted as each page is touched).
  int64_t rss_anon_kb = 0;
  int64_t rss_file_kb = 0;
  int64_t rss_shmem_kb = 0;
  // Bytes in malloc's in-use chunks (all arenas, mmapped blocks included): a leak grows it,
  // while RSS also grows by memory the allocator keeps after a free. glibc counts the freed
  // chunks each thread caches (tcache) as in use, so it may rise by up to some 100 KiB per
  // thread before it levels off; GLIBC_TUNABLES=glibc.malloc.tcache_count=0 takes that out.
  int64_t heap_kb = 0;
  // What malloc holds from the system (mallinfo2 arena + hblkhd: the sbrk'd heap and every other
  // arena, plus the mmapped blocks): the heap in use plus the free chunks it keeps.
  int64_t arena_kb = 0;
  int64_t fds = 0;
  int64_t threads = 0;
};

// VmRSS, RssAnon, RssFile and RssShmem from /proc/self/status.
void read_status(Resources& r) {
  struct Field {
    const char* name;
    int64_t Resources::*field;
  };
  static constexpr Field kFields[] = {{"VmRSS:", &Resources::rss_kb},
                                      {"RssAnon:", &Resources::rss_anon_kb},
                                      {"RssFile:", &Resources::rss_file_kb},
                                      {"RssShmem:", &Resources::rss_shmem_kb}};
  size_t found = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    for (const Field& f : kFields) {
      const std::string_view name(f.name);
      if (line.compare(0, name.size(), name) == 0) {
        r.*f.field = std::stoll(line.substr(name.size()));
        ++found;
      }
    }
  }
  if (found != std::size(kFields)) {
    throw Error("soak: no VmRSS, RssAnon, RssFile or RssShmem in /proc/self/status");
  }
}

// Entries of a /proc directory, without "." and "..". The directory's own descriptor is open
// while we count: it is counted every time alike, so a difference is still a difference.
int64_t entries(const char* path) {
  DIR* dir = ::opendir(path);
  if (dir == nullptr) throw Error(fmt::format("soak: cannot read {}", path));
  int64_t count = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count;
}

Resources measure() {
  Resources r;
  read_status(r);
  const struct mallinfo2 info = ::mallinfo2();
  r.heap_kb = static_cast<int64_t>((info.uordblks + info.hblkhd) / 1024);
  r.arena_kb = static_cast<int64_t>((info.arena + info.hblkhd) / 1024);
  r.fds = entries("/proc/self/fd");
  r.threads = entries("/proc/self/task");
  return r;
}

// ---- the model ------------------------------------------------------------------------------

// Tensors in backward order: three weights the plans compress and three biases that travel
// uncompressed (default plan), about 19k elements, so a step costs microseconds of compute and
// the soak measures the engine, not the arithmetic.
std::vector<TensorInfo> model_tensors() {
  return {{"head.bias", 10},        {"head.weight", 2560},    {"layer2.bias", 128},
          {"layer2.weight", 8192}, {"layer1.bias", 128}, {"layer1.weight", 8192}};
}

// Parameters and their gradient buffers. Gradients are pseudo-gradients of a noisy quadratic:
// g = 0.1 p + noise(seed, tensor, step, rank), so they depend on the rank, the step and the
// parameters, and the parameters keep moving (the noise) while staying bounded (the pull to 0).
class Model {
 public:
  Model(std::vector<TensorInfo> tensors, uint64_t seed) : tensors_(std::move(tensors)), seed_(seed) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      // The same initial values on every rank: shared randomness.
      const CounterRng shared(seed_, t, 0, CounterRng::kSharedRank);
      params_.emplace_back(tensors_[t].elements);
      for (size_t i = 0; i < params_[t].size(); ++i) params_[t][i] = 2 * shared.uniform(i) - 1;
      grads_.emplace_back(tensors_[t].elements);
    }
  }

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  std::span<float> gradient(size_t t) { return grads_[t]; }

  void make_gradients(uint64_t step, int rank) {
    for (size_t t = 0; t < params_.size(); ++t) {
      const CounterRng noise(seed_, t, step, static_cast<uint32_t>(rank));
      for (size_t i = 0; i < params_[t].size(); ++i) {
        grads_[t][i] = 0.1f * params_[t][i] + (noise.uniform(i) - 0.5f);
      }
    }
  }

  // Plain SGD with the mean gradient the engine wrote back.
  void apply(float learning_rate) {
    for (size_t t = 0; t < params_.size(); ++t) {
      for (size_t i = 0; i < params_[t].size(); ++i) params_[t][i] -= learning_rate * grads_[t][i];
    }
  }

  // FNV-1a 64 of every parameter's bytes.
  uint64_t hash() const {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const auto& p : params_) {
      for (std::byte b : std::as_bytes(std::span<const float>(p))) {
        h = (h ^ static_cast<uint8_t>(b)) * 0x100000001b3ULL;
      }
    }
    return h;
  }

  double mean_abs() const {
    double sum = 0;
    size_t n = 0;
    for (const auto& p : params_) {
      for (float x : p) sum += std::abs(x);
      n += p.size();
    }
    return sum / static_cast<double>(n);
  }

 private:
  std::vector<TensorInfo> tensors_;
  uint64_t seed_;
  std::vector<std::vector<float>> params_, grads_;
};

Plan plan_for(const std::vector<TensorInfo>& tensors, const std::string& option) {
  DefaultPlanSettings settings;
  settings.bucket_bytes = 64u << 10;      // two compressed buckets and one uncompressed
  settings.min_compress_elements = 1024;  // the weights are compressed, the biases not
  settings.compressed = parse_option(option);
  return make_default_plan(tensors, settings);
}

// ---- checkpoint files -----------------------------------------------------------------------

void write_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw Error(fmt::format("soak: cannot write the checkpoint {}", path));
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<std::byte> bytes(in ? static_cast<size_t>(in.tellg()) : 0);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!in) throw Error(fmt::format("soak: cannot read the checkpoint {}", path));
  return bytes;
}

// ---- the run --------------------------------------------------------------------------------

struct Sample {
  uint64_t step = 0;
  size_t plan = 0;           // index into the rotation, live at this sample
  Resources live;            // with the engine running
  double steps_per_second = 0;  // since the previous sample, plan changes and checkpoints in
  double mean_abs_parameter = 0;  // stays bounded and non-zero if the training is sane
};

// What the process holds at a plan change, before it: the engine (its threads and its node
// transports) and the run's own buffers, or with --new-engine-per-plan only the transport and
// the run's buffers (the old engine destroyed, the next not built yet). Either way it must not
// change from one plan change to the next.
struct Idle {
  uint64_t step = 0;
  Resources between;
};

class Soak {
 public:
  Soak(std::shared_ptr<Transport> world, const Settings& settings)
      : world_(std::move(world)),
        settings_(settings),
        model_(model_tensors(), settings.seed),
        checkpoint_path_(fmt::format("{}/gradcomp_soak.{}.rank{}.state", settings.checkpoint_dir,
                                     ::getpid(), world_->rank())) {
    // Room for every record up front: the soak's own bookkeeping must not grow what it measures.
    samples_.reserve(settings.steps / sample_every_of(settings) + 2);
    idles_.reserve(settings.steps / settings.plan_every + 1);
  }

  ~Soak() { std::remove(checkpoint_path_.c_str()); }

  void run() {
    engine_ = build_engine(plan_);
    last_sample_time_ = Clock::now();
    const auto start = Clock::now();
    for (uint64_t done = 1; done <= settings_.steps; ++done) {
      train_step(done - 1);
      // The checkpoint comes before a plan change due at the same step: it saves a mature state.
      if (done % settings_.checkpoint_every == 0) checkpoint(done);
      if (done % settings_.plan_every == 0) change_plan(done);
      if (sample_due(done)) sample(done);
    }
    wall_seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
  }

  const std::vector<Sample>& samples() const { return samples_; }
  const std::vector<Idle>& idles() const { return idles_; }
  const Model& model() const { return model_; }
  double wall_seconds() const { return wall_seconds_; }
  uint64_t checkpoints() const { return checkpoints_; }
  uint64_t resumes() const { return resumes_; }

 private:
  std::unique_ptr<Engine> build_engine(size_t plan) {
    EngineOptions options;
    options.seed = settings_.seed;
    // Two ranks per emulated node, so the hierarchical plan has nodes and leaders to split.
    options.local_size = world_->size() % 2 == 0 ? 2 : 1;
    auto engine = std::make_unique<Engine>(
        world_, plan_for(model_.tensors(), settings_.rotation[plan]), options);
    engine->set_learning_rate(settings_.learning_rate);
    return engine;
  }

  void train_step(uint64_t step) {
    model_.make_gradients(step, world_->rank());
    for (size_t t = 0; t < model_.tensors().size(); ++t) engine_->ready(t, model_.gradient(t));
    engine_->synchronize();
    model_.apply(static_cast<float>(settings_.learning_rate));
  }

  // Saves the state to a file and loads it back: odd checkpoints into a freshly built engine
  // (a resume), even ones into the live engine. Either way a save right after the load must
  // give the same bytes.
  void checkpoint(uint64_t step) {
    const uint64_t number = step / settings_.checkpoint_every;
    write_file(checkpoint_path_, engine_->save_state());
    const auto saved = read_file(checkpoint_path_);
    if (number % 2 == 1) {
      engine_.reset();  // as a restarted process: the old engine is gone before the new one
      engine_ = build_engine(plan_);
      ++resumes_;
    }
    engine_->load_state(saved);
    if (engine_->save_state() != saved) {
      throw Error(fmt::format("soak: step {}: the state saved after load_state differs from the "
                              "checkpoint loaded",
                              step));
    }
    ++checkpoints_;
  }

  void change_plan(uint64_t step) {
    plan_ = (plan_ + 1) % settings_.rotation.size();
    if (!settings_.new_engine_per_plan) {
      idles_.push_back({step, measure()});
      engine_->set_plan(plan_for(model_.tensors(), settings_.rotation[plan_]));
      return;
    }
    engine_.reset();
    idles_.push_back({step, measure()});
    engine_ = build_engine(plan_);
  }

  bool sample_due(uint64_t step) const {
    return step % sample_every_of(settings_) == 0 || step == baseline_step_of(settings_) ||
           step == settings_.steps;
  }

  void sample(uint64_t step) {
    const auto now = Clock::now();
    const uint64_t since = samples_.empty() ? step : step - samples_.back().step;
    const double seconds = std::chrono::duration<double>(now - last_sample_time_).count();
    samples_.push_back(
        {step, plan_, measure(), static_cast<double>(since) / seconds, model_.mean_abs()});
    last_sample_time_ = now;
    if (world_->rank() == 0) print_progress(samples_.back());
  }

  // Rank 0's own figures as they come: a long run shows how it goes (and a run that is stopped
  // leaves them behind); the table of every rank comes at the end.
  void print_progress(const Sample& sample) const {
    const auto in_mib = [](int64_t kb) { return static_cast<double>(kb) / 1024; };
    const Resources& r = sample.live;
    fmt::print("step {}: {}; rank 0: RSS {:.2f} MiB (anon {:.2f}, file {:.2f}, shmem {:.2f}), "
               "heap {:.2f} MiB in use of {:.2f} held, {} fds, {} threads; {:.0f} steps/s\n",
               sample.step, settings_.rotation[sample.plan], in_mib(r.rss_kb),
               in_mib(r.rss_anon_kb), in_mib(r.rss_file_kb), in_mib(r.rss_shmem_kb),
               in_mib(r.heap_kb), in_mib(r.arena_kb), r.fds, r.threads, sample.steps_per_second);
    std::fflush(stdout);
  }

 private:
  std::shared_ptr<Transport> world_;
  const Settings& settings_;
  Model model_;
  std::string checkpoint_path_;
  size_t plan_ = 0;
  std::unique_ptr<Engine> engine_;
  std::vector<Sample> samples_;
  std::vector<Idle> idles_;
  Clock::time_point last_sample_time_;
  double wall_seconds_ = 0;
  uint64_t checkpoints_ = 0, resumes_ = 0;
};

// ---- gathering and checking on rank 0 -------------------------------------------------------

// Every rank's figures, indexed [rank][sample] (the same samples on every rank).
struct Gathered {
  std::vector<std::vector<Resources>> live, idle;
  std::vector<uint64_t> hashes;
};

// Resources' figures in one order, to send them as one array of int64.
constexpr int64_t Resources::*kFigures[] = {
    &Resources::rss_kb,       &Resources::rss_anon_kb, &Resources::rss_file_kb,
    &Resources::rss_shmem_kb, &Resources::heap_kb,     &Resources::arena_kb,
    &Resources::fds,          &Resources::threads};
constexpr size_t kFigureCount = std::size(kFigures);

std::vector<int64_t> flatten(const std::vector<Sample>& samples, const std::vector<Idle>& idles) {
  std::vector<int64_t> out;
  auto add = [&](const Resources& r) {
    for (auto field : kFigures) out.push_back(r.*field);
  };
  for (const auto& s : samples) add(s.live);
  for (const auto& i : idles) add(i.between);
  return out;
}

template <class T>
std::vector<T> allgather(Transport& world, const std::vector<T>& mine) {
  std::vector<T> all(mine.size() * static_cast<size_t>(world.size()));
  world.allgather(std::as_bytes(std::span<const T>(mine)), std::as_writable_bytes(std::span<T>(all)))
      ->wait(world.timeout());
  return all;
}

Gathered gather(Transport& world, const Soak& soak) {
  const auto all = allgather(world, flatten(soak.samples(), soak.idles()));
  const auto hashes = allgather(world, std::vector<uint64_t>{soak.model().hash()});
  const size_t per_rank = all.size() / static_cast<size_t>(world.size());
  Gathered g;
  g.hashes = hashes;
  for (int r = 0; r < world.size(); ++r) {
    auto& live = g.live.emplace_back();
    auto& idle = g.idle.emplace_back();
    for (size_t k = 0; k < per_rank / kFigureCount; ++k) {
      const int64_t* v = all.data() + static_cast<size_t>(r) * per_rank + kFigureCount * k;
      Resources figures;
      for (size_t f = 0; f < kFigureCount; ++f) figures.*kFigures[f] = v[f];
      (k < soak.samples().size() ? live : idle).push_back(figures);
    }
  }
  return g;
}

struct Verdict {
  bool identical = true;
  bool finite = true;  // a diverged run could be identical everywhere and still wrong
  // Percent, the largest over ranks, from the baseline step to the end. Only RSS is checked;
  // the rest is reported.
  double max_heap_growth = -100;  // malloc's bytes in use, in percent of the baseline's RSS
  double max_rss_growth = -100;   // VmRSS, in percent of the baseline's RSS
  // The same over the first and the second half after the baseline (by the sample in between,
  // which the halves share): a leak grows alike in both, an allocator that settles mostly in
  // the first.
  uint64_t middle_step = 0;
  double max_rss_growth_halves[2] = {-100, -100};
  Resources largest_change;       // per figure, the largest change over ranks (kB or count)
  bool rss_ok = true;
  std::string resources_compared;  // which figures the fds/threads check compared
  bool fds_ok = true, threads_ok = true;
  bool ok() const { return identical && finite && rss_ok && fds_ok && threads_ok; }
};

size_t sample_index(const std::vector<Sample>& samples, uint64_t step) {
  for (size_t k = 0; k < samples.size(); ++k) {
    if (samples[k].step == step) return k;
  }
  throw Error(fmt::format("soak: no sample at step {}", step));
}

// fds and threads: compared at plan changes (the first plan change from the baseline step on,
// against the last), where the same things are alive each time; with fewer than two
// plan changes after the baseline, the live figures at the baseline and the end, when the
// same plan runs at both.
void check_counts(const Soak& soak, const Gathered& g, size_t baseline, const Settings& s,
                  Verdict& v) {
  const auto& idles = soak.idles();
  const auto first = std::find_if(idles.begin(), idles.end(),
                                  [&](const Idle& i) { return i.step >= baseline_step_of(s); });
  const auto grew = [&](const std::vector<std::vector<Resources>>& figures, size_t from, size_t to) {
    for (const auto& rank : figures) {
      if (rank[to].fds > rank[from].fds) v.fds_ok = false;
      if (rank[to].threads > rank[from].threads) v.threads_ok = false;
    }
  };
  if (idles.end() - first >= 2) {
    const size_t from = static_cast<size_t>(first - idles.begin());
    grew(g.idle, from, idles.size() - 1);
    v.resources_compared = fmt::format("at plan changes, step {} vs step {}", first->step,
                                       idles.back().step);
  } else if (soak.samples()[baseline].plan == soak.samples().back().plan) {
    grew(g.live, baseline, soak.samples().size() - 1);
    v.resources_compared = fmt::format("live, step {} vs step {}", soak.samples()[baseline].step,
                                       soak.samples().back().step);
  } else {
    v.resources_compared = "not compared (too few plan changes after the baseline step)";
  }
}

Verdict check(const Soak& soak, const Gathered& g, const Settings& s) {
  Verdict v;
  v.identical = std::all_of(g.hashes.begin(), g.hashes.end(),
                            [&](uint64_t h) { return h == g.hashes[0]; });
  v.finite = std::isfinite(soak.model().mean_abs());
  const size_t baseline = sample_index(soak.samples(), baseline_step_of(s));
  const size_t middle = (baseline + soak.samples().size() - 1) / 2;
  v.middle_step = soak.samples()[middle].step;
  for (size_t f = 0; f < kFigureCount; ++f) v.largest_change.*kFigures[f] = INT64_MIN;
  for (const auto& rank : g.live) {
    const Resources &from = rank[baseline], &to = rank.back();
    const auto percent = [&](int64_t kb) {
      return 100.0 * static_cast<double>(kb) / static_cast<double>(from.rss_kb);
    };
    v.max_heap_growth = std::max(v.max_heap_growth, percent(to.heap_kb - from.heap_kb));
    v.max_rss_growth = std::max(v.max_rss_growth, percent(to.rss_kb - from.rss_kb));
    const int64_t halves[2] = {rank[middle].rss_kb - from.rss_kb, to.rss_kb - rank[middle].rss_kb};
    for (int h = 0; h < 2; ++h) {
      v.max_rss_growth_halves[h] = std::max(v.max_rss_growth_halves[h], percent(halves[h]));
    }
    for (auto field : kFigures) {
      v.largest_change.*field = std::max(v.largest_change.*field, to.*field - from.*field);
    }
  }
  v.rss_ok = v.max_rss_growth < s.max_rss_growth;
  check_counts(soak, g, baseline, s, v);
  return v;
}

// ---- the report -----------------------------------------------------------------------------

std::string mib(int64_t kb) { return fmt::format("{:.2f}", static_cast<double>(kb) / 1024); }

// "lo..hi" of one figure of sample k over the ranks.
std::string over_ranks(const std::vector<std::vector<Resources>>& figures, size_t k,
                       int64_t Resources::*field, bool in_mib) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const auto& rank : figures) {
    lo = std::min(lo, rank[k].*field);
    hi = std::max(hi, rank[k].*field);
  }
  if (in_mib) return mib(lo) + ".." + mib(hi);
  return lo == hi ? std::to_string(lo) : fmt::format("{}..{}", lo, hi);
}

void print_table(const Soak& soak, const Gathered& g, const Settings& s) {
  fmt::print("{:>7}  {:<58} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13} {:>5} {:>7} {:>7} {:>8}\n",
             "step", "plan (live)", "RSS MiB", "anon MiB", "file MiB", "shmem MiB",
             "heap MiB", "held MiB", "fds", "threads", "steps/s", "mean|p|");
  for (size_t k = 0; k < soak.samples().size(); ++k) {
    const Sample& sample = soak.samples()[k];
    fmt::print("{:>7}  {:<58} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13} {:>5} {:>7} {:>7.0f} "
               "{:>8.5f}\n",
               sample.step, s.rotation[sample.plan],
               over_ranks(g.live, k, &Resources::rss_kb, true),
               over_ranks(g.live, k, &Resources::rss_anon_kb, true),
               over_ranks(g.live, k, &Resources::rss_file_kb, true),
               over_ranks(g.live, k, &Resources::rss_shmem_kb, true),
               over_ranks(g.live, k, &Resources::heap_kb, true),
               over_ranks(g.live, k, &Resources::arena_kb, true),
               over_ranks(g.live, k, &Resources::fds, false),
               over_ranks(g.live, k, &Resources::threads, false), sample.steps_per_second,
               sample.mean_abs_parameter);
  }
  fmt::print("(heap: malloc's bytes in use; held: what malloc holds from the system, in use or "
             "free)\n");
  fmt::print("(min..max over ranks; rank 0 also serves the rendezvous store under gradcomp launch)\n");
}

void print_verdict(const Soak& soak, const Gathered& g, const Verdict& v, const Settings& s) {
  fmt::print("wall {:.1f} s, {:.0f} steps/s; {} checkpoints ({} resumed into a new engine), "
             "{} plan changes\n",
             soak.wall_seconds(), static_cast<double>(s.steps) / soak.wall_seconds(),
             soak.checkpoints(), soak.resumes(), soak.idles().size());
  const Resources& c = v.largest_change;
  fmt::print("RSS growth from step {} to {}: {:+.3f}% (largest over ranks; limit {}%): {}; "
             "largest changes in KiB: anon {:+}, file {:+}, shmem {:+}, malloc held {:+}, "
             "malloc in use {:+}\n",
             baseline_step_of(s), s.steps, v.max_rss_growth, s.max_rss_growth,
             v.rss_ok ? "ok" : "FAILED", c.rss_anon_kb, c.rss_file_kb, c.rss_shmem_kb,
             c.arena_kb, c.heap_kb);
  fmt::print("RSS growth by halves: step {} to {} {:+.3f}%, step {} to {} {:+.3f}% (a leak grows "
             "alike in both; an allocator settling, mostly in the first)\n",
             baseline_step_of(s), v.middle_step, v.max_rss_growth_halves[0], v.middle_step,
             s.steps, v.max_rss_growth_halves[1]);
  fmt::print("heap (malloc in use) growth from step {} to {}: {:+.3f}% of RSS (largest over ranks; "
             "reported, not checked: it counts the chunks glibc's thread caches keep)\n",
             baseline_step_of(s), s.steps, v.max_heap_growth);
  fmt::print("fds {}, threads {} ({})\n", v.fds_ok ? "flat" : "GREW",
             v.threads_ok ? "flat" : "GREW", v.resources_compared);
  fmt::print("parameters bit-identical on all {} ranks: {} (fnv1a64 {:016x}); finite: {}\n",
             g.hashes.size(), v.identical ? "yes" : "NO", g.hashes[0], v.finite ? "yes" : "NO");
}

nlohmann::json resources_json(const Resources& r) {
  return {{"rss_kb", r.rss_kb},           {"rss_anon_kb", r.rss_anon_kb},
          {"rss_file_kb", r.rss_file_kb}, {"rss_shmem_kb", r.rss_shmem_kb},
          {"heap_kb", r.heap_kb},         {"arena_kb", r.arena_kb},
          {"fds", r.fds},                 {"threads", r.threads}};
}

nlohmann::json report(const Transport& world, const Soak& soak, const Gathered& g,
                      const Verdict& v, const Settings& s) {
  nlohmann::json samples = nlohmann::json::array(), idles = nlohmann::json::array();
  for (size_t k = 0; k < soak.samples().size(); ++k) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& rank : g.live) ranks.push_back(resources_json(rank[k]));
    samples.push_back({{"step", soak.samples()[k].step},
                       {"plan", s.rotation[soak.samples()[k].plan]},
                       {"steps_per_second", soak.samples()[k].steps_per_second},
                       {"mean_abs_parameter", soak.samples()[k].mean_abs_parameter},
                       {"ranks", ranks}});
  }
  for (size_t k = 0; k < soak.idles().size(); ++k) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& rank : g.idle) ranks.push_back(resources_json(rank[k]));
    idles.push_back({{"step", soak.idles()[k].step}, {"ranks", ranks}});
  }
  nlohmann::json hashes = nlohmann::json::array();
  for (uint64_t h : g.hashes) hashes.push_back(fmt::format("{:016x}", h));
  return {{"transport", world.name()},
          {"ranks", world.size()},
          {"settings",
           {{"steps", s.steps}, {"plan_every", s.plan_every},
            {"checkpoint_every", s.checkpoint_every}, {"baseline_step", baseline_step_of(s)},
            {"max_rss_growth_percent", s.max_rss_growth}, {"seed", s.seed},
            {"learning_rate", s.learning_rate}, {"rotation", s.rotation}}},
          {"wall_seconds", soak.wall_seconds()},
          {"steps_per_second", static_cast<double>(s.steps) / soak.wall_seconds()},
          {"checkpoints", soak.checkpoints()},
          {"resumes", soak.resumes()},
          {"samples", samples},
          {"at_plan_changes", idles},
          {"parameter_hashes", hashes},
          {"checks",
           {{"bit_identical", v.identical}, {"finite", v.finite}, {"rss_growth_percent", v.max_rss_growth},
            {"rss_growth_percent_by_halves", {{"middle_step", v.middle_step},
                                              {"first", v.max_rss_growth_halves[0]},
                                              {"second", v.max_rss_growth_halves[1]}}},
            {"largest_change", resources_json(v.largest_change)},
            {"heap_growth_percent_of_rss", v.max_heap_growth}, {"rss_ok", v.rss_ok}, {"fds_flat", v.fds_ok}, {"threads_flat", v.threads_ok},
            {"counts_compared", v.resources_compared}, {"passed", v.ok()}}}};
}

// ---- main -----------------------------------------------------------------------------------

void resolve_defaults(Settings& s) {
  if (s.plan_every == 0 && !s.rotation.empty()) {
    s.plan_every = std::max<uint64_t>(1, baseline_step_of(s) / s.rotation.size());
  }
}

void check_settings(const Settings& s) {
  if (s.steps == 0 || s.checkpoint_every == 0 || s.rotation.empty()) {
    throw Error("soak: --steps and --checkpoint-every must be above 0, --rotation not empty");
  }
  if (baseline_step_of(s) > s.steps) {
    throw Error(fmt::format("soak: --baseline-step {} is after the last step {}",
                            baseline_step_of(s), s.steps));
  }
  for (const auto& option : s.rotation) plan_for(model_tensors(), option);  // a typo fails here
}

// Rank 0 decides; every rank exits with its verdict, so the launcher reports the run as one.
int agree(Transport& world, int verdict) {
  int32_t value = verdict;
  world.broadcast(std::as_writable_bytes(std::span<int32_t>(&value, 1)), 0)->wait(world.timeout());
  return value;
}

int run(Settings settings) {
  resolve_defaults(settings);
  check_settings(settings);
  std::shared_ptr<Transport> world = make_transport();
  Soak soak(world, settings);
  if (world->rank() == 0) {
    fmt::print("soak: {} ranks over {}, {} steps, plan change every {}, checkpoint every {}\n",
               world->size(), world->name(), settings.steps, settings.plan_every,
               settings.checkpoint_every);
    if (settings.plan_every * (settings.rotation.size() - 1) >= baseline_step_of(settings)) {
      fmt::print("note: some plans of the rotation first run after the baseline step {}: the "
                 "growth includes what their first use costs\n",
                 baseline_step_of(settings));
    }
    std::fflush(stdout);
  }
  soak.run();
  const Gathered gathered = gather(*world, soak);
  int verdict = 0;
  if (world->rank() == 0) {
    const Verdict v = check(soak, gathered, settings);
    print_table(soak, gathered, settings);
    print_verdict(soak, gathered, v, settings);
    if (!settings.out.empty()) {
      std::ofstream(settings.out) << report(*world, soak, gathered, v, settings).dump(2) << "\n";
      fmt::print("wrote {}\n", settings.out);
    }
    verdict = v.ok() ? 0 : 1;
  }
  return agree(*world, verdict);
}

}  // namespace
}  // namespace gradcomp::soak

int main(int argc, char** argv) {
  gradcomp::soak::Settings settings;
  CLI::App app{"gradcomp_soak: many small steps with plan changes and checkpoints; checks that "
               "memory, open files and threads stay flat and that all ranks end bit-identical. "
               "Run one process per rank: gradcomp launch -n 4 -- gradcomp_soak"};
  app.add_option("--steps", settings.steps, "training steps")->capture_default_str();
  app.add_option("--plan-every", settings.plan_every,
                 "steps between plan changes (default: the baseline step over the number of "
                 "plans in --rotation, so every plan runs before the baseline)");
  app.add_option("--checkpoint-every", settings.checkpoint_every,
                 "steps between checkpoints (saved, written, read and loaded back)")
      ->capture_default_str();
  app.add_option("--sample-every", settings.sample_every,
                 "steps between measurements (default: steps / 10)");
  app.add_option("--baseline-step", settings.baseline_step,
                 "the step the heap, RSS, fds and threads are compared from (default: steps / 10)");
  app.add_option("--max-rss-growth", settings.max_rss_growth,
                 "largest growth of resident memory (VmRSS) allowed from the baseline step to "
                 "the end, in percent of the baseline's (malloc's bytes in use are reported)")
      ->capture_default_str();
  app.add_option("--rotation", settings.rotation,
                 "plan options in rotation, short form codec|feedback|route, ';'-separated")
      ->delimiter(';')
      ->capture_default_str();
  app.add_flag("--new-engine-per-plan", settings.new_engine_per_plan,
               "change plans by building a new engine instead of Engine::set_plan");
  app.add_option("--learning-rate", settings.learning_rate, "SGD step size")->capture_default_str();
  app.add_option("--seed", settings.seed, "seed of the model and of the codecs")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", settings.checkpoint_dir,
                 "where each rank writes its checkpoint file")
      ->capture_default_str();
  app.add_option("--out", settings.out, "JSON report written by rank 0");
  CLI11_PARSE(app, argc, argv);
  try {
    return gradcomp::soak::run(settings);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradcomp_soak: %s\n", e.what());
    return 1;
  }
}
