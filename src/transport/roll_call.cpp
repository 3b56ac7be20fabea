#include "gradcomp/roll_call.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "transport/seconds_text.h"

namespace gradcomp {
namespace {

std::string unreachable(const Attendance& board, const std::string& why) {
  // A store that does not answer is a TCP store, which rank 0 serves (file stores always do).
  return fmt::format("{} does not answer either: rank 0, which serves it, probably died or "
                     "stopped{}",
                     board.where(), why.empty() ? "" : " (" + why + ")");
}

// The roll call itself, on the calling thread: may block as long as the board does.
std::string call_the_roll(Attendance& board, int rank, int size, Milliseconds grace) {
  board.sign(rank);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int q = 0; q < size; ++q) {
      if (q != rank && !board.signed_by(q)) missing.push_back(q);
    }
    if (missing.empty()) return "every peer is alive and saw the failure too";
    if (std::chrono::steady_clock::now() > deadline) break;
    // A failure path only: polling costs nothing that matters.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return fmt::format(
      "rank{} {} did not answer within {} s: died, stopped, or no longer "
      "exchanging",
      missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), seconds_text(grace));
}

}  // namespace

Milliseconds roll_call_grace(Milliseconds timeout) {
  return std::clamp(timeout / 2, Milliseconds(200), Milliseconds(2000));
}

std::string roll_call(std::shared_ptr<Attendance> board, int rank, int size, Milliseconds grace) {
  struct Verdict {
    std::mutex mutex;
    std::condition_variable cv;
    std::optional<std::string> text;
  };
  auto verdict = std::make_shared<Verdict>();
  // Detached, holding its own references: a board that does not answer may keep it blocked
  // after we have given up on it.
  std::thread([verdict, board, rank, size, grace] {
    std::string text;
    try {
      text = call_the_roll(*board, rank, size, grace);
    } catch (const std::exception& e) {
      text = unreachable(*board, e.what());
    }
    std::lock_guard lock(verdict->mutex);
    verdict->text = std::move(text);
    verdict->cv.notify_all();
  }).detach();
  std::unique_lock lock(verdict->mutex);
  const auto answered = [&] { return verdict->text.has_value(); };
  if (verdict->cv.wait_for(lock, 2 * grace + Milliseconds(500), answered)) {
    return *verdict->text;
  }
  return unreachable(*board, "");
}

}  // namespace gradcomp
