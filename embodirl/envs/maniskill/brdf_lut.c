/* A smaller BRDF look-up table for SAPIEN on a software Vulkan device (lavapipe).
 *
 * The first time a process renders, SAPIEN's renderer (svulkan2) fills a 512 x 512 table of the split-sum
 * specular BRDF with an importance-sampling compute shader. On lavapipe that shader runs on the CPU: about
 * 13 CPU-seconds per simulator process on this project's 2-core machine, several times the rest of building
 * a ManiSkill scene, paid again by every simulator process of every run. The table serves image-based
 * lighting; with the ManiSkill scenes embodirl ships, camera and video frames are bit-identical with a
 * 128 x 128 table (tests/envs/test_brdf_lut.py checks it).
 *
 * scripts/setup.sh builds this file into .deps/vulkan/brdf_lut.so beside the bundled lavapipe, and
 * embodirl.runtime.configure() loads it with RTLD_GLOBAL before SAPIEN is imported (EMBODIRL_BRDF_LUT=full
 * skips it). svulkan2 calls svulkan2::shader::generateBRDFLUT(unsigned) through its procedure linkage table,
 * so the dynamic linker binds that call to the definition below, which calls svulkan2's own with the size
 * capped at 128 (the default of sapien.pysapien.internal_renderer.Context.create_brdf_lut).
 *
 * x86-64 only: the function returns a std::shared_ptr, which the System V x86-64 ABI passes back through a
 * hidden pointer in the first argument register (other ABIs use another register for it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#if !defined(__x86_64__)
#error "brdf_lut.c follows the x86-64 System V calling convention"
#endif

#define GENERATE "_ZN8svulkan26shader15generateBRDFLUTEj"
#define MAX_SIZE 128u

typedef void *(*generate_fn)(void *result, unsigned size);

static unsigned calls, last_size;

/* How often the table was built in this process, and the size of the last one (read by the tests). */
unsigned embodirl_brdf_lut_calls(void) { return calls; }
unsigned embodirl_brdf_lut_size(void) { return last_size; }

void *_ZN8svulkan26shader15generateBRDFLUTEj(void *result, unsigned size);

static generate_fn svulkan2_definition(void *caller) {
  /* The caller is inside svulkan2; look the symbol up in that library only, not in the global scope
     (which would find this definition again). */
  Dl_info info;
  void *lib = NULL;
  if (dladdr(caller, &info) && info.dli_fname) lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) lib = dlopen("libsvulkan2.so", RTLD_LAZY | RTLD_NOLOAD);
  generate_fn found = lib ? (generate_fn)dlsym(lib, GENERATE) : NULL;
  if (!found || found == _ZN8svulkan26shader15generateBRDFLUTEj) {
    fprintf(stderr, "embodirl brdf_lut.so: svulkan2's generateBRDFLUT was not found; "
                    "set EMBODIRL_BRDF_LUT=full to render without this library\n");
    abort();
  }
  return found;
}

void *_ZN8svulkan26shader15generateBRDFLUTEj(void *result, unsigned size) {
  static generate_fn original;
  if (!original) original = svulkan2_definition(__builtin_return_address(0));
  last_size = size < MAX_SIZE ? size : MAX_SIZE;
  calls++;
  return original(result, last_size);
}
