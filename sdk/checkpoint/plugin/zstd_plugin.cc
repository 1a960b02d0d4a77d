// HDF5 dynamically loaded filter plugin for Zstandard (id 32015), so that
// HDF5_PLUGIN_PATH=<build>/lib/hdf5-plugins lets h5py and h5dump read
// oomguard checkpoint shards. The entry points are the plugin ABI that
// HDF5's H5PL loader looks up by name.
#include <H5PLextern.h>

#include "sdk/checkpoint/zstd_filter.h"

extern "C" {

__attribute__((visibility("default"))) H5PL_type_t H5PLget_plugin_type(void) { return H5PL_TYPE_FILTER; }

__attribute__((visibility("default"))) const void* H5PLget_plugin_info(void) {
  return oomguard::ckpt::ZstdFilterClass();
}

}  // extern "C"
