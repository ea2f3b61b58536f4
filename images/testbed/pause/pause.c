/* The sandbox ("pause") process of every pod on the test bed's node: holds the pod's
 * namespaces, reaps orphans, exits on SIGTERM or SIGINT. Built static, image FROM scratch. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  signal(SIGTERM, on_stop);
  signal(SIGINT, on_stop);
  signal(SIGCHLD, on_child);
  for (;;) pause();
}
