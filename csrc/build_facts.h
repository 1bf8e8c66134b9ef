// Facts that depend on how the extension was built rather than on its code.
#pragma once

namespace hicache {

// The archs compiled in, as setup.py spelled them (e.g. "80;90+PTX").
const char* arch_list();

}  // namespace hicache
