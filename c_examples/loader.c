/*
 * The seed scenario: four consecutive loads of a model with Qwen3-4B's parameter shapes in bf16
 * (hidden 2560, intermediate 9728, 36 layers, 32 query / 8 key-value heads of dim 128, vocabulary
 * 151936, tied embeddings: 4,022,468,096 parameters, 8,044,936,192 bytes) on one device.
 *
 * Each load does what transformers does: plan with the free memory the device reports (a loader
 * offloads to the CPU what does not fit), warm the allocator up with the model's size, reserve
 * every parameter, and, once the model is dropped, release them all.
 *
 * With PyTorch's allocator the warm-up adds a model's worth on top of the cache at every load
 * and the reported free memory shrinks (transformers PR #37920: offload at the third load of an
 * 8.2 GB model on a 24 GB card). With resmem, reserved memory stays at the model's size and the
 * reported free memory stays at the device's size.
 *
 * Exits non-zero if reserved memory exceeds the model's size by more than 2% or any load would
 * offload.
 */
#include <stdio.h>
#include <stdlib.h>
#include "resmem.h"

#define HIDDEN 2560ull
#define INTERMEDIATE 9728ull
#define LAYERS 36ull
#define Q_HEADS 32ull
#define KV_HEADS 8ull
#define HEAD_DIM 128ull
#define VOCAB 151936ull
#define BYTES_PER_PARAM 2ull /* bf16 */
#define LOADS 4

/* Parameter sizes in bytes, in the order a checkpoint lists them. */
static size_t model_params(unsigned long long *sizes) {
  size_t n = 0;
  unsigned long long layer;
  sizes[n++] = VOCAB * HIDDEN; /* embed_tokens (tied with lm_head) */
  for (layer = 0; layer < LAYERS; layer++) {
    sizes[n++] = HIDDEN;                        /* input_layernorm */
    sizes[n++] = Q_HEADS * HEAD_DIM * HIDDEN;   /* q_proj */
    sizes[n++] = KV_HEADS * HEAD_DIM * HIDDEN;  /* k_proj */
    sizes[n++] = KV_HEADS * HEAD_DIM * HIDDEN;  /* v_proj */
    sizes[n++] = HIDDEN * Q_HEADS * HEAD_DIM;   /* o_proj */
    sizes[n++] = HEAD_DIM;                      /* q_norm */
    sizes[n++] = HEAD_DIM;                      /* k_norm */
    sizes[n++] = HIDDEN;                        /* post_attention_layernorm */
    sizes[n++] = INTERMEDIATE * HIDDEN;         /* gate_proj */
    sizes[n++] = INTERMEDIATE * HIDDEN;         /* up_proj */
    sizes[n++] = HIDDEN * INTERMEDIATE;         /* down_proj */
  }
  sizes[n++] = HIDDEN; /* final norm */
  return n;
}

static double gib(unsigned long long bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

int main(void) {
  static unsigned long long sizes[1 + 11 * LAYERS + 1];
  static void *ptrs[1 + 11 * LAYERS + 1];
  size_t count = model_params(sizes), i;
  unsigned long long params = 0, model_bytes;
  int load, failures = 0;
  /* Line-buffered even into a pipe, so that an error on stderr follows the lines before it. */
  setvbuf(stdout, NULL, _IOLBF, 0);

  for (i = 0; i < count; i++) params += sizes[i];
  model_bytes = params * BYTES_PER_PARAM;
  printf("model: %llu parameters, %llu bytes (%.2f GiB) in %zu tensors\n", params, model_bytes,
         gib(model_bytes), count);
  printf("%-5s %16s %16s %14s %14s %9s\n", "load", "free (resmem)", "free (driver)",
         "reserved", "allocated", "offload");

  for (load = 1; load <= LOADS; load++) {
    size_t free_bytes = 0, total_bytes = 0;
    rm_stats before, after;
    int offload;
    if (rm_mem_get_info(0, &free_bytes, &total_bytes) != RM_SUCCESS ||
        rm_get_stats(0, &before) != RM_SUCCESS) {
      fprintf(stderr, "querying device 0 failed: %s\n", rm_last_error());
      return 1;
    }
    offload = model_bytes > free_bytes;
    if (rm_warmup(0, (size_t)model_bytes) != RM_SUCCESS) {
      fprintf(stderr, "rm_warmup failed: %s\n", rm_last_error());
      return 1;
    }
    for (i = 0; i < count; i++) {
      if (rm_reserve(0, (size_t)(sizes[i] * BYTES_PER_PARAM), NULL, &ptrs[i]) != RM_SUCCESS) {
        fprintf(stderr, "rm_reserve of tensor %zu failed: %s\n", i, rm_last_error());
        return 1;
      }
    }
    if (rm_get_stats(0, &after) != RM_SUCCESS) {
      fprintf(stderr, "rm_get_stats failed: %s\n", rm_last_error());
      return 1;
    }
    printf("%-5d %13.2f GiB %13.2f GiB %10.2f GiB %10.2f GiB %9s\n", load, gib(free_bytes),
           gib(free_bytes - before.reusable_bytes), gib(after.reserved_bytes),
           gib(after.allocated_bytes), offload ? "yes" : "no");
    if (offload) {
      fprintf(stderr, "load %d: a loader would offload (model %llu > free %zu)\n", load,
              model_bytes, free_bytes);
      failures++;
    }
    if ((double)after.reserved_bytes > 1.02 * (double)model_bytes) {
      fprintf(stderr, "load %d: reserved %llu exceeds the model's %llu by more than 2%%\n", load,
              (unsigned long long)after.reserved_bytes, model_bytes);
      failures++;
    }
    if (after.allocated_bytes < model_bytes) {
      fprintf(stderr, "load %d: allocated %llu is less than the model\n", load,
              (unsigned long long)after.allocated_bytes);
      failures++;
    }
    for (i = 0; i < count; i++) {
      if (rm_release(ptrs[i]) != RM_SUCCESS) {
        fprintf(stderr, "rm_release failed: %s\n", rm_last_error());
        return 1;
      }
    }
  }
  {
    rm_stats end;
    if (rm_get_stats(0, &end) != RM_SUCCESS) return 1;
    printf("after %d loads: peak reserved %.2f GiB (%.4f x the model), %llu driver allocations, "
           "%llu of %llu reservations served from cache\n",
           LOADS, gib(end.peak_reserved_bytes),
           (double)end.peak_reserved_bytes / (double)model_bytes,
           (unsigned long long)end.driver_allocs, (unsigned long long)end.cache_hits,
           (unsigned long long)end.reserve_calls);
    if (end.live_blocks != 0 || end.allocated_bytes != 0) failures++;
  }
  return failures == 0 ? 0 : 1;
}
