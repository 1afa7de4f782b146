/* Does this x86 box run AMX tile instructions? (bench/peers/setup_llamacpp.py's AMX note)
 *
 * On 2026-12-03 llama.cpp's -march=native build SIGILLed at `tilezero` in ggml's AMX kernel
 * on a KVM Xeon that lists amx_tile/amx_int8. This probe asks Linux for tile-data permission,
 * loads a tile config and runs tilezero/tilestored in 2 threads for 3,000 rounds across
 * context switches; it ran clean there, so the fault is not plain "AMX is absent".
 *
 *     gcc -O1 -pthread -mamx-tile -mamx-int8 bench/peers/amx_probe.c -o /tmp/amx_probe
 *     /tmp/amx_probe    # prints XCR0's tile bits, the permission result, "thread N ok"
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

static void *rounds(void *arg) {
    struct tile_cfg cfg;
    static __thread int8_t buf[1024];
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    for (int i = 0; i < 3000; i++) {
        _tile_zero(0);
        _tile_stored(0, buf, 64);
        if (i % 3 == 0)
            usleep(200);
        else
            sched_yield();
    }
    _tile_release();
    printf("thread %ld ok\n", (long)arg);
    return NULL;
}

int main(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    printf("XCR0 tile bits (17 cfg, 18 data): %u %u\n", (lo >> 17) & 1, (lo >> 18) & 1);
    printf("ARCH_REQ_XCOMP_PERM -> %ld\n", syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
    fflush(stdout);
    pthread_t t[2];
    for (long i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, rounds, (void *)i);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    return 0;
}
