/* A library a caller would like a privileged program to load: it says so when loaded. */
#include <stdio.h>

__attribute__((constructor)) static void loaded(void) {
  printf("hostile library loaded\n");
  fflush(stdout);
}
