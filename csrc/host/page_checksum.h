// The payload checksum of the file storage backend's page objects
// (python/hicache/storage/checksum.py holds the definition and a numpy twin): over the payload as
// little-endian 64-bit words w_i (the last one zero-padded), sum_i mix(w_i ^ (i * K1)) mod 2^64,
// with mix(x) = x * K2, then x ^= x >> 31. Independent words and a sum: the compiler keeps several
// multiplies in flight, so it runs at memory speed, and a chunked computation (the word index
// carries on) equals the whole one. Plain C++.
#pragma once

#include <cstdint>
#include <cstring>

namespace hicache {

constexpr uint64_t kChecksumK1 = 0x9e3779b97f4a7c15ULL;
constexpr uint64_t kChecksumK2 = 0xbf58476d1ce4e5b9ULL;

// Adds the words of data[0, 8 * n) (word indices first, first + 1, ...) to sum; returns the new
// sum. The key (index * K1) advances by an add, so a word costs one multiply; two chains run side
// by side.
inline uint64_t checksum_words(const unsigned char* data, int64_t n, uint64_t first, uint64_t sum) {
  uint64_t a = 0, b = 0;
  uint64_t k0 = first * kChecksumK1, k1 = k0 + kChecksumK1;
  constexpr uint64_t kStep = 2 * kChecksumK1;
  int64_t i = 0;
  for (; i + 1 < n; i += 2, k0 += kStep, k1 += kStep) {
    uint64_t w0, w1;
    std::memcpy(&w0, data + 8 * i, 8);
    std::memcpy(&w1, data + 8 * i + 8, 8);
    const uint64_t x0 = (w0 ^ k0) * kChecksumK2;
    const uint64_t x1 = (w1 ^ k1) * kChecksumK2;
    a += x0 ^ (x0 >> 31);
    b += x1 ^ (x1 >> 31);
  }
  if (i < n) {
    uint64_t w;
    std::memcpy(&w, data + 8 * i, 8);
    const uint64_t x = (w ^ k0) * kChecksumK2;
    a += x ^ (x >> 31);
  }
  return sum + a + b;
}

}  // namespace hicache
