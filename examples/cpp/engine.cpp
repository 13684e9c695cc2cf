// A small inference "engine" on resmem: device memory held by RAII buffers, a model loaded four
// times in a row (warm-up, then one buffer per tensor), and the figures a loader would plan with.
// Reserved memory stays at the model's size over the loads, and every load sees the whole
// device as free, because memory the pool holds but does not use counts as free.
#include <resmem.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// A failed resmem call, with its status and rm_last_error()'s words.
struct Error : std::runtime_error {
  rm_status status;
  Error(rm_status s, const char *what) : std::runtime_error(what), status(s) {}
};

void check(rm_status status) {
  if (status != RM_SUCCESS) throw Error(status, rm_last_error());
}

// Device memory from the pool, given back when the buffer goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, std::size_t bytes, void *stream = nullptr) : bytes_(bytes) {
    check(rm_reserve(device, bytes, stream, &ptr_));
  }
  DeviceBuffer(DeviceBuffer &&other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(other.bytes_) {}
  DeviceBuffer &operator=(DeviceBuffer &&other) noexcept {
    std::swap(ptr_, other.ptr_);
    bytes_ = other.bytes_;
    return *this;
  }
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  ~DeviceBuffer() { rm_release(ptr_); }  // NULL is a no-op

  void *get() const { return ptr_; }
  std::size_t size() const { return bytes_; }

 private:
  void *ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// The tensors of a model: 32 weight matrices of 48 MiB and 32 norm vectors of 8 KiB.
std::vector<std::size_t> model_tensors() {
  std::vector<std::size_t> sizes;
  for (int layer = 0; layer < 32; ++layer) {
    sizes.push_back(48 * MiB);
    sizes.push_back(8 * 1024);
  }
  return sizes;
}

std::vector<DeviceBuffer> load(int device, const std::vector<std::size_t> &sizes) {
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  check(rm_warmup(device, total));  // allocates only what is not already reusable
  std::vector<DeviceBuffer> tensors;
  tensors.reserve(sizes.size());
  for (std::size_t s : sizes) tensors.emplace_back(device, s);
  return tensors;
}

}  // namespace

int main() {
  const int device = 0;
  const std::vector<std::size_t> sizes = model_tensors();
  std::uint64_t first_reserved = 0;
  bool grew = false;
  try {
    for (int i = 1; i <= 4; ++i) {
      std::vector<DeviceBuffer> model = load(device, sizes);
      std::size_t free_bytes = 0, total_bytes = 0;
      rm_stats stats{};
      check(rm_mem_get_info(device, &free_bytes, &total_bytes));
      check(rm_get_stats(device, &stats));
      std::printf("load %d: %zu tensors, allocated %llu MiB, reserved %llu MiB, free %zu of %zu MiB\n",
                  i, model.size(), (unsigned long long)(stats.allocated_bytes / MiB),
                  (unsigned long long)(stats.reserved_bytes / MiB), free_bytes / MiB,
                  total_bytes / MiB);
      if (i == 1) first_reserved = stats.reserved_bytes;
      grew = grew || stats.reserved_bytes != first_reserved;
      // `model` goes out of scope: every buffer goes back to the pool, ready for the next load.
    }
    rm_stats stats{};
    check(rm_get_stats(device, &stats));
    std::printf("after 4 loads: peak reserved %llu MiB, %llu driver allocations, %llu of %llu "
                "reservations served from cache\n",
                (unsigned long long)(stats.peak_reserved_bytes / MiB),
                (unsigned long long)stats.driver_allocs, (unsigned long long)stats.cache_hits,
                (unsigned long long)stats.reserve_calls);
    try {
      DeviceBuffer too_big(device, std::size_t{1} << 50);  // 1 PiB
      std::printf("a 1 PiB buffer was granted?\n");
      return 1;
    } catch (const Error &e) {
      std::printf("a 1 PiB buffer: %s\n", rm_status_string(e.status));
    }
  } catch (const Error &e) {
    std::fprintf(stderr, "engine: %s\n", e.what());
    return 1;
  }
  if (grew) {
    std::printf("reserved memory grew between loads\n");
    return 1;
  }
  return 0;
}
