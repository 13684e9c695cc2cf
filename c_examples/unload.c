/*
 * Loads and unloads libresmem.so many times, as a plugin host might, and checks that the
 * process does not grow: each cycle opens the library with dlopen, starts its pool from another
 * thread (reserve, record_stream, release, a failing call, rm_last_error), and closes it with
 * dlclose. The library must really be unloaded each time, and the heap in use (mallinfo2) may
 * not grow by more than 64 KiB over the measured cycles: about 8 KiB left per unload would be
 * over 1.5 MiB.
 *
 *   unload PATH [CYCLES]   PATH is libresmem.so; prints "unload: ... 0 failure(s)"
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "resmem.h"

#define WARMUP 20
#define BOUND (64 * 1024)

typedef rm_status (*reserve_fn)(int, size_t, void *, void **);
typedef rm_status (*one_ptr_fn)(void *);
typedef rm_status (*record_fn)(void *, void *);
typedef const char *(*text_fn)(void);

static int failures = 0;

static void *sym(void *lib, const char *name) {
  void *f = dlsym(lib, name);
  if (f == NULL) {
    fprintf(stderr, "FAIL %s not found: %s\n", name, dlerror());
    exit(1);
  }
  return f;
}

static void *use_the_pool(void *lib) {
  reserve_fn reserve;
  one_ptr_fn release;
  record_fn record;
  text_fn last_error;
  void *p = NULL;
  *(void **)&reserve = sym(lib, "rm_reserve");
  *(void **)&release = sym(lib, "rm_release");
  *(void **)&record = sym(lib, "rm_record_stream");
  *(void **)&last_error = sym(lib, "rm_last_error");
  if (reserve(0, 3 << 20, NULL, &p) != RM_SUCCESS || record(p, NULL) != RM_SUCCESS ||
      release(p) != RM_SUCCESS) {
    fprintf(stderr, "FAIL a call failed: %s\n", last_error());
    failures++;
  }
  if (reserve(99, 1, NULL, &p) != RM_ERROR_INVALID_DEVICE || last_error()[0] == '\0') {
    fprintf(stderr, "FAIL device 99 was not refused with a message\n");
    failures++;
  }
  return NULL;
}

static int mapped(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib != NULL) {
    dlclose(lib);
  }
  return lib != NULL;
}

int main(int argc, char **argv) {
  int cycles = argc > 2 ? atoi(argv[2]) : 220, i;
  size_t start = 0, end = 0;
  if (argc < 2 || cycles <= WARMUP) {
    fprintf(stderr, "usage: unload PATH [CYCLES > %d]\n", WARMUP);
    return 2;
  }
  if (mapped(argv[1])) {
    fprintf(stderr, "FAIL %s is loaded before the first dlopen\n", argv[1]);
    return 1;
  }
  for (i = 0; i < cycles; i++) {
    pthread_t thread;
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
      fprintf(stderr, "FAIL dlopen: %s\n", dlerror());
      return 1;
    }
    if (pthread_create(&thread, NULL, use_the_pool, lib) != 0 || pthread_join(thread, NULL) != 0) {
      fprintf(stderr, "FAIL no thread\n");
      return 1;
    }
    dlclose(lib);
    if (mapped(argv[1])) {
      fprintf(stderr, "FAIL cycle %d: the library stays loaded after dlclose\n", i);
      failures++;
      break;
    }
    if (i == WARMUP - 1) {
      start = mallinfo2().uordblks;
    }
  }
  end = mallinfo2().uordblks;
  if (end > start + BOUND) {
    fprintf(stderr, "FAIL the heap grew by %zu bytes over %d cycles (%zu per cycle)\n",
            end - start, cycles - WARMUP, (end - start) / (size_t)(cycles - WARMUP));
    failures++;
  }
  printf("unload: %d cycles, heap in use %zu bytes after %d, %zu after %d (%+ld); %d failure(s)\n",
         cycles, start, WARMUP, end, cycles, (long)end - (long)start, failures);
  return failures == 0 ? 0 : 1;
}
