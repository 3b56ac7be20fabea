// KeptThread: a job runs on a thread kept for its role; once joined, the next job of the role
// runs on the same thread (no new thread, the same kernel thread id), jobs alive together get
// threads of their own, roles do not share threads, and a forked child starts afresh.
#include "gradcomp/kept_thread.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/sanitizers.h"

namespace gradcomp {
namespace {

pid_t kernel_thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

int threads_of_this_process() {
  DIR* dir = ::opendir("/proc/self/task");
  int count = 0;
  while (const dirent* entry = ::readdir(dir)) count += entry->d_name[0] != '.';
  ::closedir(dir);
  return count;
}

// The kernel thread id a job of `role` runs on.
pid_t thread_of_a_job(const std::string& role) {
  pid_t id = 0;
  KeptThread thread(role, [&] { id = kernel_thread_id(); });
  thread.join();
  return id;
}

TEST(KeptThread, JoinWaitsForTheJob) {
  std::atomic<bool> done{false};
  KeptThread thread("kt-join", [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    done = true;
  });
  EXPECT_TRUE(thread.joinable());
  thread.join();
  EXPECT_TRUE(done);
  EXPECT_FALSE(thread.joinable());
  thread.join();  // a second join does nothing
}

TEST(KeptThread, TheNextJobOfTheRoleRunsOnTheSameThread) {
  const pid_t first = thread_of_a_job("kt-reuse");
  const int threads = threads_of_this_process();
  for (int i = 0; i < 50; ++i) {
    ASSERT_EQ(thread_of_a_job("kt-reuse"), first) << "job " << i << " ran on another thread";
  }
  EXPECT_EQ(threads_of_this_process(), threads);
  EXPECT_NE(first, kernel_thread_id());
}

TEST(KeptThread, TheThreadIsNamedAfterItsRole) {
  char name[16] = {};
  KeptThread thread("kt-named", [&] { pthread_getname_np(pthread_self(), name, sizeof name); });
  thread.join();
  EXPECT_STREQ(name, "kt-named");
}

TEST(KeptThread, JobsAliveTogetherRunOnThreadsOfTheirOwn) {
  std::barrier all_started(3);  // would never complete if two jobs shared a thread
  pid_t ids[3] = {};
  std::vector<KeptThread> threads;
  for (auto& id : ids) {
    threads.emplace_back("kt-together", [&all_started, &id] {
      id = kernel_thread_id();
      all_started.arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], ids[2]);
  // Three idle threads of the role now: three more jobs alive together start none.
  const int before = threads_of_this_process();
  std::barrier again(3);
  threads.clear();
  for (int i = 0; i < 3; ++i) threads.emplace_back("kt-together", [&again] { again.arrive_and_wait(); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(threads_of_this_process(), before);
}

TEST(KeptThread, RolesDoNotShareThreads) {
  const pid_t a = thread_of_a_job("kt-role-a");
  const pid_t b = thread_of_a_job("kt-role-b");
  EXPECT_NE(a, b);
  EXPECT_EQ(thread_of_a_job("kt-role-a"), a);
  EXPECT_EQ(thread_of_a_job("kt-role-b"), b);
}

TEST(KeptThread, MovedHandleWaitsAndDestructorJoins) {
  std::atomic<int> runs{0};
  {
    KeptThread first("kt-move", [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ++runs;
    });
    KeptThread second(std::move(first));
    EXPECT_FALSE(first.joinable());  // NOLINT(bugprone-use-after-move): checked on purpose
    EXPECT_TRUE(second.joinable());
    KeptThread third;
    third = std::move(second);
  }  // third's destructor waits for the job
  EXPECT_EQ(runs, 1);
}

TEST(KeptThread, AForkedChildRunsJobsOnThreadsOfItsOwn) {
  if (testing::kThreadSanitizer) {
    GTEST_SKIP() << "ThreadSanitizer does not start threads after a multi-threaded fork (it runs "
                    "in the Release and ASan builds)";
  }
  const pid_t parents_thread = thread_of_a_job("kt-fork");  // idle in the parent
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(20);  // the parent's idle thread does not exist here: a hang would be the failure
    const pid_t id = thread_of_a_job("kt-fork");
    ::_exit(id != 0 && id != parents_thread ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child was killed by signal " << WTERMSIG(status)
                                    << " (SIGALRM: a job given to a thread it does not have)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace gradcomp
