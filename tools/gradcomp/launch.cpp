#include "launch.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>

#include "cli_checks.h"
#include "gradcomp/error.h"

extern char** environ;

namespace gradcomp::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct Child {
  int rank;  // a server's index when `server`
  pid_t pid;  // also its process group: a rank's own children go down with it
  bool running = true;
  bool server = false;
  std::string name() const {
    return fmt::format("{} {}", server ? "server" : "rank", rank);
  }
};

int server_port(const LaunchOptions& o) {
  return o.server_port > 0 ? o.server_port : o.master_port + 1;
}

std::string server_store(const LaunchOptions& o) {
  return fmt::format("tcp://{}:{}", o.master_addr, server_port(o));
}

// Several ranks share this machine's cores: like torchrun, one thread each for OpenMP and for
// the BLAS, unless the user chose. torch.set_num_threads(1) does not reach an OpenBLAS that
// runs its own threads (Debian's torch), whose idle threads spin on sched_yield after every
// matrix product and take the cores the other ranks compute on (docs/python.md).
bool sets_omp_threads(const LaunchOptions& o) {
  return o.ranks > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
}

// The variables torchrun sets (one node, so GROUP_RANK is 0 and local equals global).
std::vector<std::pair<std::string, std::string>> rank_variables(const LaunchOptions& o, int rank) {
  std::vector<std::pair<std::string, std::string>> vars{
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o.ranks)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.ranks)},
      {"GROUP_RANK", "0"},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
  };
  if (sets_omp_threads(o)) vars.emplace_back("OMP_NUM_THREADS", "1");
  if (o.timeout_seconds > 0)
    vars.emplace_back("GRADCOMP_TIMEOUT", fmt::format("{}", o.timeout_seconds));
  if (o.servers > 0) {
    vars.emplace_back("GRADCOMP_SERVERS", std::to_string(o.servers));
    vars.emplace_back("GRADCOMP_SERVER_STORE", server_store(o));
  }
  return vars;
}

// The launcher's environment with the rank's variables in place of any inherited ones; a
// server gets none of them (it is told its place on its command line).
std::vector<std::string> environment_for(const LaunchOptions& o, const Child& child) {
  auto vars = rank_variables(o, child.rank);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('='));
    const bool replaced =
        std::any_of(vars.begin(), vars.end(), [&](const auto& v) { return v.first == name; });
    if (!replaced) env.emplace_back(entry);
  }
  if (child.server) return env;
  for (const auto& [name, value] : vars) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Server s's command: this program's `server`, told where the workers are.
std::vector<std::string> server_command(const LaunchOptions& o, int s) {
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) throw Error(fmt::format("launch: cannot find this program to start servers: {}", error.message()));
  std::vector<std::string> command{self.string(), "server",
                                   "--index",     std::to_string(s),
                                   "--servers",   std::to_string(o.servers),
                                   "--workers",   std::to_string(o.ranks),
                                   "--store",     server_store(o)};
  if (o.server_timeout_seconds > 0) {
    command.insert(command.end(), {"--timeout", fmt::format("{}", o.server_timeout_seconds)});
  }
  return command;
}

// Forks one rank (or server). Everything the child needs is built before fork(), so the child
// only makes async-signal-safe calls before exec.
pid_t spawn(const LaunchOptions& o, const Child& child, const sigset_t& child_mask) {
  const int rank = child.rank;
  auto args = child.server ? server_command(o, rank) : o.command;
  auto env = environment_for(o, child);
  auto argv = pointers(args);
  auto envp = pointers(env);
  const pid_t parent = ::getpid();
  const std::string cannot_run =
      fmt::format("gradcomp launch: {}: cannot run '{}': ", child.name(), argv[0]);
  const pid_t pid = ::fork();
  if (pid < 0)
    throw Error(fmt::format("launch: cannot start {}: {}", child.name(), std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    // If the launcher itself is killed (SIGKILL cannot be forwarded), the ranks go too.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    ::execvpe(argv[0], argv.data(), envp.data());
    // Only async-signal-safe calls after fork: the message was formatted before it.
    (void)!::write(2, cannot_run.data(), cannot_run.size());
    const char* reason = std::strerror(errno);
    (void)!::write(2, reason, std::strlen(reason));
    (void)!::write(2, "\n", 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
  return pid;
}

void signal_all(const std::vector<Child>& children, int sig) {
  for (const auto& c : children) {
    if (c.running) ::kill(-c.pid, sig);
  }
}

// "exited with code 3" / "was killed by signal 9 (Killed)"; the exit code the launcher returns.
std::pair<std::string, int> describe(int status) {
  if (WIFEXITED(status)) {
    return {fmt::format("exited with code {}", WEXITSTATUS(status)), WEXITSTATUS(status)};
  }
  const int sig = WTERMSIG(status);
  return {fmt::format("was killed by signal {} ({})", sig, ::strsignal(sig)), 128 + sig};
}

class Supervisor {
 public:
  Supervisor(const LaunchOptions& o, std::vector<Child> children, sigset_t signals)
      : options_(o), children_(std::move(children)), signals_(signals) {}

  int run() {
    while (running() > 0) {
      const int sig = next_signal();
      if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) interrupt(sig);
      reap();
    }
    clean_up(stopping_ ? std::chrono::milliseconds(2000) : std::chrono::milliseconds(0));
    if (interrupted_ != 0) return 128 + interrupted_;
    return exit_code_;
  }

 private:
  int running() const {
    return static_cast<int>(std::count_if(children_.begin(), children_.end(),
                                          [](const Child& c) { return c.running; }));
  }
  int workers_running() const {
    return static_cast<int>(std::count_if(children_.begin(), children_.end(),
                                          [](const Child& c) { return c.running && !c.server; }));
  }

  // Waits for a signal (SIGCHLD or one to forward). Past the notice period after a failure, it
  // stops the other ranks; past the grace period, it kills what is left.
  int next_signal() {
    if (!kill_at_ && !term_at_) return ::sigwaitinfo(&signals_, nullptr);
    const auto at = kill_at_ ? *kill_at_ : *term_at_;
    const auto left = std::max(Clock::duration::zero(), at - Clock::now());
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    const timespec ts{static_cast<time_t>(ns / 1'000'000'000),
                      static_cast<long>(ns % 1'000'000'000)};
    const int sig = ::sigtimedwait(&signals_, nullptr, &ts);
    if (sig < 0 && errno == EAGAIN && !kill_at_) {
      term_at_.reset();
      stop_others();
    } else if (sig < 0 && errno == EAGAIN) {
      fmt::print(stderr, "gradcomp launch: {} rank(s) still running after {} s; killing them\n",
                 running(), options_.grace_seconds);
      signal_all(children_, SIGKILL);
      kill_at_.reset();
    }
    return sig;
  }

  // From now on a failing rank is a consequence, not news; SIGKILL after the grace period.
  void start_grace() {
    stopping_ = true;
    kill_at_ =
        Clock::now() + std::chrono::milliseconds(static_cast<long>(options_.grace_seconds * 1000));
  }

  void stop_others() {
    if (stopping_) return;
    start_grace();
    signal_all(children_, SIGTERM);
    signal_all(children_, SIGCONT);  // a stopped rank must run to see SIGTERM
  }

  // Forwards SIGINT / SIGTERM / SIGHUP to every rank, which gets the grace period to exit.
  void interrupt(int sig) {
    if (interrupted_ == 0) interrupted_ = sig;
    signal_all(children_, sig);
    if (!stopping_) start_grace();
  }

  // Reaps every exited child: ranks, and orphans of theirs that came to us (subreaper).
  void reap() {
    int status = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      const auto c = std::find_if(children_.begin(), children_.end(),
                                  [&](const Child& child) { return child.pid == pid; });
      if (c != children_.end()) finished(*c, status);
    }
  }

  // The first rank to fail decides the exit code. The others get the notice period to see the
  // failure as an error of their own and exit with it (their message is the useful one: which
  // bucket and phase failed); then they are stopped.
  void finished(Child& c, int status) {
    c.running = false;
    const auto [how, code] = describe(status);
    if (code == 0 && !c.server && !stopping_ && exit_code_ == 0 && workers_running() == 0 &&
        running() > 0 && !term_at_) {
      // Every rank is done: the servers get the notice period to end on their own (the ranks
      // tell them to stop at exit), then are stopped.
      term_at_ = Clock::now() +
                 std::chrono::milliseconds(static_cast<long>(options_.notice_seconds * 1000));
    }
    if (code == 0 || stopping_ || exit_code_ != 0) return;
    exit_code_ = code;
    fmt::print(stderr,
               "gradcomp launch: {} (pid {}) {}; the others get {} s to end, then are "
               "stopped\n",
               c.name(), c.pid, how, options_.notice_seconds);
    term_at_ = Clock::now() +
               std::chrono::milliseconds(static_cast<long>(options_.notice_seconds * 1000));
  }

  // What the ranks left behind: after a failure it is killed; either way the orphans that
  // already exited are reaped, waiting at most `limit` for the killed ones.
  void clean_up(std::chrono::milliseconds limit) {
    if (stopping_) signal_all_groups(SIGKILL);
    const auto deadline = Clock::now() + limit;
    for (;;) {
      reap();
      if (::waitpid(-1, nullptr, WNOHANG) < 0 || Clock::now() >= deadline) return;  // ECHILD
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
      const timespec ts{static_cast<time_t>(ns.count() / 1'000'000'000),
                        static_cast<long>(ns.count() % 1'000'000'000)};
      ::sigtimedwait(&signals_, nullptr, &ts);
    }
  }

  void signal_all_groups(int sig) {
    for (const auto& c : children_) ::kill(-c.pid, sig);
  }

  const LaunchOptions& options_;
  std::vector<Child> children_;
  sigset_t signals_;
  bool stopping_ = false;
  int interrupted_ = 0;
  int exit_code_ = 0;
  std::optional<Clock::time_point> term_at_;  // end of the notice period after a failure
  std::optional<Clock::time_point> kill_at_;  // end of the grace period after SIGTERM
};

}  // namespace

int launch(const LaunchOptions& options) {
  if (options.command.empty())
    throw Error("launch: no command given (gradcomp launch -n N -- command args...)");
  if (options.ranks < 1)
    throw Error(fmt::format("launch: -n {} must be at least 1", options.ranks));
  if (options.servers > 0 && server_port(options) > 65535) {
    throw Error(fmt::format("launch: the servers' store would listen on port {} (master port + "
                            "1); give --server-port from 1 to 65535",
                            server_port(options)));
  }
  // The signals we wait for are blocked and taken with sigwaitinfo: no handler, no race
  // between a child's exit and going to sleep.
  sigset_t signals, original;
  sigemptyset(&signals);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&signals, sig);
  ::sigprocmask(SIG_BLOCK, &signals, &original);
  // Orphans of the ranks (a shell's background job) become our children, so we can reap
  // them instead of leaving zombies to an init that may not.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  if (sets_omp_threads(options)) {
    fmt::print(stderr,
               "gradcomp launch: OMP_NUM_THREADS=1 for each of the {} ranks (as torchrun sets "
               "it), so that they do not overload the cores; set OMP_NUM_THREADS to choose "
               "another count\n",
               options.ranks);
  }
  std::vector<Child> children;
  try {
    for (int s = 0; s < options.servers; ++s) {
      Child server{s, 0, true, true};
      server.pid = spawn(options, server, original);
      children.push_back(server);
    }
    for (int rank = 0; rank < options.ranks; ++rank) {
      Child worker{rank, 0};
      worker.pid = spawn(options, worker, original);
      children.push_back(worker);
    }
  } catch (const Error&) {
    for (const auto& c : children) ::kill(-c.pid, SIGKILL);
    for (const auto& c : children) ::waitpid(c.pid, nullptr, 0);
    ::sigprocmask(SIG_SETMASK, &original, nullptr);
    throw;
  }
  const int code = Supervisor(options, std::move(children), signals).run();
  ::sigprocmask(SIG_SETMASK, &original, nullptr);
  return code;
}

void add_launch_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<LaunchOptions>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks of a command with torchrun's environment (RANK, WORLD_SIZE, "
      "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); if one fails, stop "
      "the others. Usage: gradcomp launch -n N [options] -- command args...");
  cmd->add_option("-n,--nproc,--nproc-per-node,--nproc_per_node", options->ranks,
                  "Number of ranks (torchrun's --nproc_per_node is accepted too)")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--master-addr", options->master_addr, "Address of rank 0's rendezvous store")
      ->capture_default_str();
  cmd->add_option("--master-port", options->master_port, "Port of rank 0's rendezvous store")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  cmd->add_option("--timeout", options->timeout_seconds,
                  "Collective timeout in seconds for the ranks (sets GRADCOMP_TIMEOUT)")
      ->check(finite_range(1e-3, 7 * 86400.0));
  cmd->add_option("--notice", options->notice_seconds,
                  "Seconds the other ranks get to end on their own after one fails")
      ->check(finite_range(0, 3600))
      ->capture_default_str();
  cmd->add_option("--grace", options->grace_seconds,
                  "Seconds between SIGTERM and SIGKILL when stopping the ranks")
      ->check(finite_range(0, 3600))
      ->capture_default_str();
  cmd->add_option("--servers", options->servers,
                  "Dedicated parameter servers to start beside the ranks, for route 'servers' "
                  "(docs/servers.md)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  cmd->add_option("--server-port", options->server_port,
                  "Port of the servers' rendezvous store, which rank 0 serves (default: "
                  "master port + 1)")
      ->check(CLI::Range(1, 65535));
  cmd->add_option("--server-timeout", options->server_timeout_seconds,
                  "The servers' --timeout: seconds a collective with the workers may take once "
                  "under way, and their rendezvous (default: the server's, 3600)")
      ->check(finite_range(1e-3, 7 * 86400.0));
  cmd->add_option("command", options->command, "The command every rank runs (after --)")
      ->required();
  cmd->callback([options, &exit_code] { exit_code = launch(*options); });
}

}  // namespace gradcomp::tools
