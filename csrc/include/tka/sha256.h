// SHA-256 (FIPS 180-4), self-contained: the runtime checks each cubin against the
// manifest's digest before loading it.
#pragma once

#include <cstddef>
#include <string>

namespace tka {

// The SHA-256 digest of `size` bytes at `data`, as 64 lowercase hex digits.
std::string sha256_hex(const void* data, size_t size);

}  // namespace tka
