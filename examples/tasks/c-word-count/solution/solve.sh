#!/bin/bash
# Oracle solution for c-word-count: writes /app/wc.c and compiles it to /app/wc.
set -euo pipefail

cat > /app/wc.c <<'C'
#include <errno.h>
#include <stdio.h>
#include <string.h>

struct counts { unsigned long long lines, words, bytes; };

static int is_ws(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

static void count(FILE *f, struct counts *c) {
    unsigned char buf[65536];
    size_t n;
    int in_word = 0;
    c->lines = c->words = c->bytes = 0;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        c->bytes += n;
        for (size_t i = 0; i < n; i++) {
            if (buf[i] == '\n') c->lines++;
            if (is_ws(buf[i])) {
                in_word = 0;
            } else if (!in_word) {
                in_word = 1;
                c->words++;
            }
        }
    }
}

int main(int argc, char **argv) {
    struct counts c, total = {0, 0, 0};
    int status = 0;
    if (argc < 2) {
        count(stdin, &c);
        printf("%llu %llu %llu\n", c.lines, c.words, c.bytes);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            fflush(stdout);
            fprintf(stderr, "wc: %s: %s\n", argv[i], strerror(errno));
            status = 1;
            continue;
        }
        count(f, &c);
        fclose(f);
        printf("%llu %llu %llu %s\n", c.lines, c.words, c.bytes, argv[i]);
        total.lines += c.lines;
        total.words += c.words;
        total.bytes += c.bytes;
    }
    if (argc > 2)
        printf("%llu %llu %llu total\n", total.lines, total.words, total.bytes);
    return status;
}
C

gcc -O2 -o /app/wc /app/wc.c
cd /app/samples && /app/wc poem.txt notes.txt
