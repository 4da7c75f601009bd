// The warp emulator as a device for the engine's GPU backend (src/engine/gpu/emu.rs): a
// process that maps the device memory file the Rust side created, reads launches from stdin,
// runs each kernel of kernels/engine.cu and kernels/flash_mma.cu in the emulator on that memory,
// and answers `ok` on stdout. The Rust side computes every launch exactly as it would for the
// GPU (kernel name, grid, block, arguments), so the launch code and the kernels are checked
// together against the CPU backend.
//
// Built with -DENGINE_SOURCE='"path"' it runs another copy of kernels/engine.cu (a test's
// deliberately broken one; its `#include "ops/..."` finds the headers of kernels/ops/ next to
// the copy, else through `-I kernels`). Usage: engine_emu MEMORY_FILE BYTES. One command per line:
//   launch NAME GX GY GZ BLOCK ARG...   ARG: pOFFSET (a byte offset into the memory), iN (int),
//                                        lN (long), fHEX (a float's bits in hex)
//   quit
// An unknown kernel, a wrong argument count or kind, or a pointer outside the memory prints the
// reason on stderr and exits 2.
#include "warp_emu.h"
#ifdef ENGINE_SOURCE
#include ENGINE_SOURCE
#else
#include "../../kernels/engine.cu"
#endif
#include "../../kernels/flash_mma.cu"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace {

unsigned char* memory = nullptr;
size_t memory_bytes = 0;

[[noreturn]] void die(const std::string& why) {
    fprintf(stderr, "engine_emu: %s\n", why.c_str());
    exit(2);
}

struct Arg {
    char kind;
    uint64_t value;
};

template <class T>
T convert(const Arg& a, size_t index) {
    if constexpr (std::is_pointer_v<T>) {
        if (a.kind != 'p') die("argument " + std::to_string(index) + " should be a pointer");
        if (a.value > memory_bytes) die("pointer argument " + std::to_string(index) + " outside the memory");
        return reinterpret_cast<T>(memory + a.value);
    } else if constexpr (std::is_same_v<T, float>) {
        if (a.kind != 'f') die("argument " + std::to_string(index) + " should be a float");
        const uint32_t bits = static_cast<uint32_t>(a.value);
        float f;
        memcpy(&f, &bits, 4);
        return f;
    } else if constexpr (std::is_same_v<T, long>) {
        if (a.kind != 'l') die("argument " + std::to_string(index) + " should be a long");
        return static_cast<long>(a.value);
    } else {
        static_assert(std::is_same_v<T, int>, "kernel arguments are pointers, int, long or float");
        if (a.kind != 'i') die("argument " + std::to_string(index) + " should be an int");
        return static_cast<int>(static_cast<int64_t>(a.value));
    }
}

void no_copies_left() {
    if (!emu::in_flight.empty() || !emu::open_group.empty()) {
        fprintf(stderr, "warp emulator: thread %u of block %u,%u ended with cp.async copies not waited for\n", threadIdx.x, blockIdx.x,
                blockIdx.y);
        abort();
    }
}

using Kernel = std::function<void(dim3, unsigned, const std::vector<Arg>&)>;

template <class... P>
Kernel make(void (*k)(P...)) {
    return [k](dim3 grid, unsigned block, const std::vector<Arg>& a) {
        if (a.size() != sizeof...(P)) die("expected " + std::to_string(sizeof...(P)) + " arguments, got " + std::to_string(a.size()));
        [&]<size_t... I>(std::index_sequence<I...>) {
            emu::launch(k, grid, block, no_copies_left, convert<P>(a[I], I)...);
        }(std::index_sequence_for<P...>{});
    };
}

#define K(name) {#name, make(name)}

const std::map<std::string, Kernel>& kernels() {
    // ENGINE_KERNELS: every kernel the engine declares (src/engine/gpu/kernels.rs), in a
    // header the emulator's build writes and passes with `-include`.
    static const std::map<std::string, Kernel> table = {
        ENGINE_KERNELS(K)
    };
    return table;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) die("usage: engine_emu MEMORY_FILE BYTES");
    memory_bytes = std::stoull(argv[2]);
    const int fd = open(argv[1], O_RDWR);
    if (fd < 0) die(std::string("cannot open ") + argv[1]);
    void* p = mmap(nullptr, memory_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) die(std::string("cannot map ") + argv[1]);
    memory = static_cast<unsigned char*>(p);
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd, name;
        in >> cmd;
        if (cmd == "quit") break;
        if (cmd != "launch") die("unknown command `" + cmd + "`");
        dim3 grid;
        unsigned block;
        in >> name >> grid.x >> grid.y >> grid.z >> block;
        if (grid.z != 1) die("grids are two-dimensional");
        std::vector<Arg> args;
        std::string tok;
        while (in >> tok) {
            const char kind = tok[0];
            const std::string rest = tok.substr(1);
            uint64_t v = 0;
            if (kind == 'f') v = std::stoull(rest, nullptr, 16);
            else if (kind == 'i' || kind == 'l') v = static_cast<uint64_t>(std::stoll(rest));
            else if (kind == 'p') v = std::stoull(rest);
            else die("unknown argument `" + tok + "`");
            args.push_back({kind, v});
        }
        const auto it = kernels().find(name);
        if (it == kernels().end()) die("unknown kernel `" + name + "`");
        it->second(grid, block, args);
        std::cout << "ok" << std::endl;
    }
    return 0;
}
