/* The sandbox ("pause") process of the test node's pods: holds the pod's namespaces, reaps the
 * orphans it inherits as PID 1, and exits on SIGINT/SIGTERM. registry.k8s.io/pause cannot be
 * pulled here; this is built with `gcc -static` into gpulab.test/pause (tests/cluster/images.py). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) pause();
    return 0;
}
