/*
 * fork(): a child forked before resmem started uses its own pool; a child forked after gets
 * RM_ERROR_NO_DRIVER with advice instead of the parent's driver state, and the parent goes on.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "resmem.h"

static int failures = 0;

static void expect(const char *who, const char *what, rm_status got, rm_status want,
                   const char *needle) {
  const char *message = rm_last_error();
  if (got != want || (needle != NULL && strstr(message, needle) == NULL)) {
    fprintf(stderr, "FAIL %s %s: got %s, want %s, message \"%s\"\n", who, what,
            rm_status_string(got), rm_status_string(want), message);
    failures++;
  } else {
    printf("ok   %s %s %s\n", who, what, got == RM_SUCCESS ? "" : message);
  }
  fflush(stdout);
}

/* Run `child` in a forked process; its exit status. */
static int in_child(int (*child)(void *), void *arg) {
  int status = 0;
  pid_t pid;
  fflush(stdout);
  pid = fork();
  if (pid < 0) {
    perror("fork");
    return 1;
  }
  if (pid == 0) _exit(child(arg));
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 1;
  return WEXITSTATUS(status);
}

static int fresh_child(void *unused) {
  void *p = NULL;
  (void)unused;
  expect("child before start:", "rm_reserve", rm_reserve(0, 4096, NULL, &p), RM_SUCCESS, NULL);
  expect("child before start:", "rm_release", rm_release(p), RM_SUCCESS, NULL);
  return failures;
}

static int late_child(void *parent_block) {
  void *p = NULL;
  rm_stats s;
  expect("child after start:", "rm_reserve", rm_reserve(0, 4096, NULL, &p), RM_ERROR_NO_DRIVER,
         "does not survive fork()");
  expect("child after start:", "rm_release(parent's block)", rm_release(parent_block),
         RM_ERROR_NO_DRIVER, "was forked from pid");
  expect("child after start:", "rm_get_stats", rm_get_stats(0, &s), RM_ERROR_NO_DRIVER, "spawn");
  return failures;
}

int main(void) {
  void *p = NULL;
  rm_stats s;
  if (in_child(fresh_child, NULL) != 0) failures++;
  expect("parent:", "rm_reserve", rm_reserve(0, 1u << 20, NULL, &p), RM_SUCCESS, NULL);
  if (in_child(late_child, p) != 0) failures++;
  expect("parent:", "rm_release", rm_release(p), RM_SUCCESS, NULL);
  expect("parent:", "rm_get_stats", rm_get_stats(0, &s), RM_SUCCESS, NULL);
  if (s.live_blocks != 0 || s.reserve_calls != 1) {
    fprintf(stderr, "FAIL parent's books: %llu live, %llu reserve calls\n",
            (unsigned long long)s.live_blocks, (unsigned long long)s.reserve_calls);
    failures++;
  }
  printf("fork: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
