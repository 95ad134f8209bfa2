// Note [CPU allocator] (CMakeLists.txt): a program linked with the worker library allocates with
// tcmalloc when the build found it: malloc, as the dynamic linker resolves it for every library
// (LibTorch's allocations included), is tcmalloc's.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace {

TEST(CpuAllocator, MallocIsTcmallocsWhereTheBuildFoundIt) {
#if DNALLM_HAVE_TCMALLOC
  void* tc = dlsym(RTLD_DEFAULT, "tc_malloc");
  ASSERT_NE(tc, nullptr) << "tcmalloc is not loaded: the link dropped it";
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "malloc"), tc)
      << "malloc resolves to another library's (glibc's) although tcmalloc is loaded";
  void* p = std::malloc(64 << 20);  // above glibc's largest mmap threshold
  ASSERT_NE(p, nullptr);
  std::free(p);
#else
  GTEST_SKIP() << "built without tcmalloc (DNALLM_WITH_TCMALLOC=OFF or libgoogle-perftools-dev "
                  "missing)";
#endif
}

}  // namespace
