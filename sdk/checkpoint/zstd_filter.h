// The HDF5 filter class for Zstandard (id 32015), used in two places: the
// SDK registers it in-process (so HDF5 itself can create and read datasets
// whose pipeline names it), and plugin/ exports it to h5py and h5dump via
// HDF5_PLUGIN_PATH. Only this file and codec.cc go into the plugin.
#ifndef OOMGUARD_SDK_CHECKPOINT_ZSTD_FILTER_H_
#define OOMGUARD_SDK_CHECKPOINT_ZSTD_FILTER_H_

#include <hdf5.h>

namespace oomguard::ckpt {

inline constexpr H5Z_filter_t kZstdFilter = 32015;

// The filter class (static storage).
const H5Z_class2_t* ZstdFilterClass();

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_ZSTD_FILTER_H_
