// XXH3 for the checkpoint code: through xxhash's runtime dispatch where the
// library has it (cmake/OomguardOptions.cmake), so a CPU with AVX2 hashes
// with AVX2 although the build targets baseline x86-64. The hashes are the
// same either way; only the speed differs.
#ifndef OOMGUARD_SDK_CHECKPOINT_XXH_H_
#define OOMGUARD_SDK_CHECKPOINT_XXH_H_

#if defined(OOMGUARD_XXH_DISPATCH)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

#endif  // OOMGUARD_SDK_CHECKPOINT_XXH_H_
