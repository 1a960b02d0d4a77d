// The browser's own files (assets/index.html, app.css, app.js), compiled into
// the binary by embed_assets.cmake. The server serves these and nothing else:
// there is no filesystem path from a request to a file.
//
// Thread-safety: constant data.
#ifndef OOMGUARD_SDK_SERVER_ASSETS_H_
#define OOMGUARD_SDK_SERVER_ASSETS_H_

#include <string_view>

namespace oomguard::server {

struct EmbeddedAsset {
  std::string_view name;  // file name under assets/, e.g. "app.js"
  std::string_view data;
};

// nullptr when `name` is not one of the embedded files.
const EmbeddedAsset* FindAsset(std::string_view name);

// The content type for an asset name, by extension.
std::string_view AssetContentType(std::string_view name);

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_ASSETS_H_
