/*
 * The test node's sandbox ("pause") container, written for anneal's test
 * tier (issue 17): it holds a pod's namespaces, reaps the orphans the pod
 * leaves to it, and ends on SIGINT or SIGTERM. Built static with musl-gcc
 * and packed FROM scratch by `anneal-oci` (tests/testinfra/src/node.rs).
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, 0, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = stop;
    sigaction(SIGINT, &sa, 0);
    sigaction(SIGTERM, &sa, 0);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, 0);
    for (;;) {
        pause();
    }
}
