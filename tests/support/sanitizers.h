// Whether this test program is built with a sanitizer: GCC defines __SANITIZE_ADDRESS__ and
// __SANITIZE_THREAD__, clang answers __has_feature (the ASan tree is built with clang, the
// ThreadSanitizer tree with GCC).
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRADCOMP_TESTING_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define GRADCOMP_TESTING_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(GRADCOMP_TESTING_ASAN)
#define GRADCOMP_TESTING_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(GRADCOMP_TESTING_TSAN)
#define GRADCOMP_TESTING_TSAN 1
#endif

namespace gradcomp::testing {

#if defined(GRADCOMP_TESTING_ASAN)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#if defined(GRADCOMP_TESTING_TSAN)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace gradcomp::testing
