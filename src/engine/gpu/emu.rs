//! The warp emulator as a [`Device`] (tests only): device memory is a file mapped both here
//! and by `tests/warp_emu/engine_emu.cpp` (the kernels' source compiled for the CPU with the
//! emulator's headers), launches go to that process over a pipe, one line each, and GEMM plans
//! run through the CPU interpreter of cuBLASLt ([`crate::engine::lt::interpret`]) on the mapped
//! arena. Everything the CUDA device would be given, the emulator is given. A captured graph
//! is the recorded work, replayed launch by launch with the arguments fixed at capture, as a
//! CUDA graph replays its nodes.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};

use memmap2::MmapMut;

use super::{Arg, Device, Launch, SdpaCall, Sizes, Space, Work};
use crate::device::cudnn::{SdpaCache, SdpaDesc, SdpaLib, SdpaPtrs, interpret as sdpa_interpret};

/// cuDNN's stand-in in the emulator: builds nothing and needs no workspace; the device runs
/// each call through the interpreter of its maths.
struct Interpreted;

impl SdpaLib for Interpreted {
    type Graph = ();
    fn build(&mut self, _: &SdpaDesc) -> anyhow::Result<((), usize)> {
        Ok(((), 0))
    }
    fn alloc_workspace(&mut self, bytes: usize) -> anyhow::Result<u64> {
        anyhow::bail!("the emulator's cuDNN needs no workspace ({bytes} bytes asked)")
    }
    fn execute(&self, _: &(), _: &SdpaPtrs, _: u64) -> anyhow::Result<()> {
        Ok(())
    }
}
use crate::engine::lt::{self, LtPlan};

/// Builds the emulator into `dir/name`, with `engine_source` in place of kernels/engine.cu.
pub(super) fn build(dir: &Path, name: &str, engine_source: Option<&Path>, act_bf16: bool) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(dir).expect("temp dir is writable");
    let exe = dir.join(name);
    let mut cmd = Command::new("g++");
    cmd.args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-o"]).arg(&exe);
    // The emulator's stand-ins for CUDA's headers first; then kernels/, for the ops' shared
    // device maths (`#include "ops/..."`) of a copy of engine.cu outside it.
    cmd.arg("-I").arg(root.join("tests/warp_emu/include"));
    cmd.arg("-I").arg(root.join("kernels"));
    if act_bf16 {
        cmd.arg("-DENGINE_ACT_BF16");
    }
    if let Some(src) = engine_source {
        cmd.arg(format!("-DENGINE_SOURCE=\"{}\"", src.display()));
    }
    // The table of kernels, from their one declaration (`kernels.rs`).
    let table = dir.join(format!("{name}_kernels.h"));
    let entries: Vec<String> = super::kernels::ALL.iter().map(|k| format!("K({k})")).collect();
    std::fs::write(&table, format!("#define ENGINE_KERNELS(K) {}\n", entries.join(", "))).expect("temp dir is writable");
    cmd.arg("-include").arg(&table);
    let out = cmd
        .arg(root.join("tests/warp_emu/engine_emu.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run g++ (the warp emulator needs a C++20 compiler): {e}"));
    assert!(out.status.success(), "g++ failed on the engine's emulator:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// A copy of kernels/engine.cu and its headers (kernels/ops/, kernels/engine/) in `dir/name/`,
/// with `from` replaced by `to` in `file` (a path under kernels/, where `from` must occur
/// once): a kernel broken on purpose, for [`build`]'s `engine_source`. Returns the copy of
/// engine.cu, whose `#include "ops/..."` and `"engine/..."` then find the copied headers next
/// to it.
pub(super) fn mutant(dir: &Path, name: &str, file: &str, from: &str, to: &str) -> PathBuf {
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let copy = dir.join(name);
    std::fs::create_dir_all(copy.join("ops")).expect("temp dir is writable");
    let mut files = vec![PathBuf::from("engine.cu")];
    for dir in ["ops", "engine"] {
        std::fs::create_dir_all(copy.join(dir)).expect("temp dir is writable");
        for e in std::fs::read_dir(kernels.join(dir)).expect("kernels/ops and kernels/engine exist") {
            files.push(Path::new(dir).join(e.expect("kernels/ is readable").file_name()));
        }
    }
    let mut mutated = false;
    for f in files {
        let mut src = std::fs::read_to_string(kernels.join(&f)).expect("a kernel source");
        if f == Path::new(file) {
            assert_eq!(src.matches(from).count(), 1, "`{from}` should occur once in kernels/{file}");
            src = src.replace(from, to);
            mutated = true;
        }
        std::fs::write(copy.join(&f), src).expect("temp dir is writable");
    }
    assert!(mutated, "kernels/{file} is not engine.cu or a header of kernels/ops or kernels/engine");
    copy.join("engine.cu")
}

/// A directory of this test process for the emulator's files.
pub(super) fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("pipeline-engine-emu-{}", std::process::id()))
}

/// The emulator of the project's kernels, built once per test process.
pub(super) fn emulator() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build(&temp_dir(), "engine_emu", None, false))
}

/// The emulator of the bf16-activation build of the kernels (`-DENGINE_ACT_BF16`), built once
/// per test process.
pub(super) fn emulator_bf16() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build(&temp_dir(), "engine_emu_bf16", None, true))
}

struct Process {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// Device memory in a mapped file and the emulator process that runs kernels on it.
pub(super) struct EmuDevice {
    exe: PathBuf,
    file: PathBuf,
    memory: Option<Mutex<MmapMut>>,
    process: Option<Mutex<Process>>,
    /// Byte offset of each space in the file, and its elements.
    spaces: Vec<(Space, usize, usize)>,
    /// Captured graphs by slot.
    graphs: Vec<Vec<Work>>,
    /// Every kernel launched so far.
    launched: std::sync::Arc<Mutex<std::collections::BTreeSet<String>>>,
    /// GEMMs with their inputs rounded to bf16 (the GPU's default maths), else in f32.
    bf16_gemms: bool,
    /// Timing marks: the emulator finishes each launch before the host goes on, so the host's
    /// clock at a mark is the device's.
    marks: Mutex<super::Marks<std::time::Instant>>,
    /// cuDNN's stand-in: the graph cache the CUDA device keeps, over a library that builds
    /// nothing (the calls run through [`sdpa_interpret::run`]), or why there is no cuDNN (a
    /// device without it, for the fallback's tests).
    sdpa: Result<SdpaCache<Interpreted>, String>,
    /// NCCL's stand-in ([`super::emu_comm`]), once [`Device::comm_init`] gave it the ranks.
    comm: Option<super::emu_comm::EmuComm>,
    /// The device's memory in bytes, as a GPU's: `alloc` past it fails as cudaMalloc does
    /// (out of memory). None: no limit.
    capacity: Option<usize>,
}

impl EmuDevice {
    /// A device running the emulator `exe`, its memory in `file` (created by `alloc`).
    pub(super) fn new(exe: &Path, file: PathBuf) -> Self {
        Self {
            exe: exe.to_path_buf(),
            file,
            memory: None,
            process: None,
            spaces: Vec::new(),
            graphs: Vec::new(),
            launched: Default::default(),
            bf16_gemms: false,
            marks: Mutex::new(super::Marks::default()),
            sdpa: Ok(SdpaCache::new(Interpreted)),
            comm: None,
            capacity: None,
        }
    }

    /// A device of `bytes` of memory: allocations past it fail as a full GPU's do.
    pub(super) fn with_capacity(mut self, bytes: usize) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// A device without cuDNN (`why`), as a GPU machine without libcudnn.
    pub(super) fn without_cudnn(mut self, why: &str) -> Self {
        self.sdpa = Err(why.to_string());
        self
    }

    /// GEMMs as the GPU's bf16 tensor cores compute them (inputs rounded to bf16).
    pub(super) fn with_bf16_gemms(mut self) -> Self {
        self.bf16_gemms = true;
        self
    }

    /// The names of every kernel launched so far.
    pub(super) fn launched(&self) -> std::collections::BTreeSet<String> {
        self.launched.lock().expect("the launch record").clone()
    }

    /// The record of launched kernels, shared (readable after the device moved into an engine).
    pub(super) fn launch_record(&self) -> std::sync::Arc<Mutex<std::collections::BTreeSet<String>>> {
        self.launched.clone()
    }

    /// Byte offset of element `off` of `space`, checked.
    fn byte(&self, space: Space, off: usize) -> usize {
        let &(_, base, len) = self.spaces.iter().find(|s| s.0 == space).expect("the device is allocated");
        assert!(off <= len, "element {off} outside the {len}-element {space:?} space");
        base + off * space.elem_bytes()
    }
}

impl EmuDevice {
    /// A GEMM whose operands are not all in the f32 arena (bf16 activations): each operand's
    /// elements gathered as f32 into one scratch arena, the plan interpreted there, and C written
    /// back in its space's type (bf16: rounded to nearest even, as cuBLASLt stores a bf16 D).
    fn gemm_spaces(&self, plan: &LtPlan, spaces: [Space; 3]) {
        let extent = |l: lt::LtLayout, stride: i64| {
            let one = if l.rows == 0 || l.cols == 0 { 0 } else { (l.cols as usize - 1) * l.ld as usize + l.rows as usize };
            one + (plan.batch as usize - 1) * stride.unsigned_abs() as usize
        };
        let ops = [
            (plan.a_off, extent(plan.a, plan.stride_a)),
            (plan.b_off, extent(plan.b, plan.stride_b)),
            (plan.c_off, extent(plan.c, plan.stride_c)),
        ];
        // C must not share an element with A or B in its own space (cuBLASLt's rule; checked here
        // because the copies below are disjoint whatever the originals were).
        for k in 0..2 {
            let ((off, len), (c_off, c_len)) = (ops[k], ops[2]);
            assert!(
                spaces[k] != spaces[2] || len == 0 || c_len == 0 || off + len <= c_off || c_off + c_len <= off,
                "lt plan: C overlaps operand {k} in the {:?} space",
                spaces[2]
            );
        }
        assert!([plan.stride_a, plan.stride_b, plan.stride_c].iter().all(|&s| s >= 0), "lt plan: a negative batch stride across spaces");
        let mut scratch: Vec<f32> = Vec::new();
        let mut at = [0; 3];
        for (k, &(off, len)) in ops.iter().enumerate() {
            at[k] = scratch.len();
            if spaces[k].is_bf16() {
                let bits = self.read_half(spaces[k], off, len).expect("reading a bf16 GEMM operand");
                scratch.extend(bits.into_iter().map(|b| half::bf16::from_bits(b).to_f32()));
            } else {
                scratch.extend(self.read(spaces[k], off, len).expect("reading an f32 GEMM operand").into_iter().map(f32::from_bits));
            }
        }
        let local = LtPlan { a_off: at[0], b_off: at[1], c_off: at[2], ..*plan };
        lt::interpret_rounding(&local, &mut scratch, self.bf16_gemms);
        let (off, len) = ops[2];
        let c = &scratch[at[2]..at[2] + len];
        if spaces[2].is_bf16() {
            let bits: Vec<u16> = c.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
            self.put_half(spaces[2], off, &bits);
        } else {
            let words: Vec<u32> = c.iter().map(|x| x.to_bits()).collect();
            self.put(spaces[2], off, &words);
        }
    }

    /// Writes words at element `off` of a 4-byte space (under the memory's lock).
    fn put(&self, space: Space, off: usize, words: &[u32]) {
        let at = self.byte(space, off + words.len()) - words.len() * 4;
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        for (k, w) in words.iter().enumerate() {
            m[at + 4 * k..at + 4 * k + 4].copy_from_slice(&w.to_ne_bytes());
        }
    }

    /// Writes bf16 bits at element `off` of a 2-byte space (under the memory's lock).
    fn put_half(&self, space: Space, off: usize, bits: &[u16]) {
        let at = self.byte(space, off + bits.len()) - bits.len() * 2;
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        for (k, b) in bits.iter().enumerate() {
            m[at + 2 * k..at + 2 * k + 2].copy_from_slice(&b.to_ne_bytes());
        }
    }
}

impl super::emu_comm::Memory for EmuDevice {
    fn get(&self, space: Space, off: usize, len: usize) -> Vec<f32> {
        if space.is_bf16() {
            let bits = self.read_half(space, off, len).expect("a collective's piece in a bf16 space the host reads");
            bits.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect()
        } else {
            self.words(space, off, len).into_iter().map(f32::from_bits).collect()
        }
    }

    fn set(&self, space: Space, off: usize, values: &[f32]) {
        if space.is_bf16() {
            self.put_half(space, off, &values.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<_>>());
        } else {
            self.put(space, off, &values.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        if let Some(p) = self.process.take() {
            let mut p = p.into_inner().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(p.stdin, "quit");
            let _ = p.child.wait();
        }
        let _ = std::fs::remove_file(&self.file);
    }
}

impl Device for EmuDevice {
    fn name(&self) -> String {
        "warp emulator".into()
    }

    fn alloc(&mut self, sizes: Sizes) -> anyhow::Result<()> {
        let mut bytes = 0;
        for s in Space::ALL {
            let len = match s {
                Space::Arena => sizes.arena,
                Space::Aux => sizes.aux,
                Space::Half => sizes.half,
                Space::Tokens => sizes.tokens,
                Space::Act => sizes.act,
                Space::Mirror => sizes.mirror,
            };
            let size = (len * s.elem_bytes()).div_ceil(256) * 256;
            if let Some(cap) = self.capacity
                && bytes + size > cap
            {
                // As the CUDA device words it (`cuda.rs`), with the driver's error.
                anyhow::bail!(
                    "allocating the engine's {s:?} space on the GPU: out of memory ({size} bytes asked, {} free of {cap})",
                    cap - bytes
                );
            }
            self.spaces.push((s, bytes, len));
            bytes += size;
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&self.file)?;
        file.set_len(bytes as u64)?;
        // SAFETY: the file is this device's own (a fresh temp file); only the emulator process,
        // which runs while this side waits for its answer, maps it besides.
        let map = unsafe { MmapMut::map_mut(&file)? };
        let mut child =
            Command::new(&self.exe).arg(&self.file).arg(bytes.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
        let (stdin, stdout) = (child.stdin.take().expect("piped"), BufReader::new(child.stdout.take().expect("piped")));
        self.memory = Some(Mutex::new(map));
        self.process = Some(Mutex::new(Process { child, stdin, stdout }));
        Ok(())
    }

    fn launch(&self, l: &Launch) {
        self.launched.lock().expect("the launch record").insert(l.kernel.to_string());
        let mut line = format!("launch {} {} {} {} {}", l.kernel, l.grid[0], l.grid[1], l.grid[2], l.block);
        for a in &l.args {
            line += &match *a {
                Arg::Ptr(s, off) => format!(" p{}", self.byte(s, off)),
                Arg::I32(x) => format!(" i{x}"),
                Arg::I64(x) => format!(" l{x}"),
                Arg::F32(x) => format!(" f{:x}", x.to_bits()),
            };
        }
        let mut p = self.process.as_ref().expect("the device is allocated").lock().expect("the emulator lock");
        writeln!(p.stdin, "{line}").and_then(|_| p.stdin.flush()).expect("the emulator reads its commands");
        let mut answer = String::new();
        p.stdout.read_line(&mut answer).expect("the emulator answers");
        assert_eq!(answer.trim(), "ok", "the emulator failed on `{line}` (its stderr above)");
    }

    fn gemm(&self, plan: &LtPlan, spaces: [Space; 3]) {
        if spaces != [Space::Arena; 3] {
            return self.gemm_spaces(plan, spaces);
        }
        let base = self.byte(Space::Arena, 0);
        let len = self.spaces[0].2;
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        let bytes = &mut m[base..base + len * 4];
        // SAFETY: the arena's bytes are 4-aligned (the map is page-aligned, the arena first) and
        // any bit pattern is an f32.
        let arena = unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut f32, len) };
        lt::interpret_rounding(plan, arena, self.bf16_gemms);
    }

    fn write_half(&mut self, space: Space, off: usize, bits: &[u16]) -> anyhow::Result<()> {
        anyhow::ensure!(space.is_bf16() && space != Space::Half, "{space:?} is not a bf16 space written from the host");
        self.put_half(space, off, bits);
        Ok(())
    }

    fn read_half(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u16>> {
        anyhow::ensure!(space.is_bf16() && space != Space::Half, "{space:?} is not a bf16 space read from the host");
        let at = self.byte(space, off + len) - len * 2;
        let m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        Ok((0..len).map(|k| u16::from_ne_bytes(m[at + 2 * k..at + 2 * k + 2].try_into().expect("2 bytes"))).collect())
    }

    fn write(&mut self, space: Space, off: usize, words: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(!space.is_bf16(), "{space:?} is not a 4-byte space");
        self.put(space, off, words);
        Ok(())
    }

    fn sdpa_prepare(&mut self, desc: &SdpaDesc) -> anyhow::Result<()> {
        self.sdpa.as_mut().map_err(|why| anyhow::anyhow!("{why}"))?.prepare(desc)
    }

    fn sdpa(&self, call: &SdpaCall) {
        // As the CUDA device: a call runs only with its graph prepared.
        let cache = self.sdpa.as_ref().unwrap_or_else(|why| panic!("a cuDNN call queued on a device without cuDNN ({why})"));
        let ptrs = call.ptrs(|space, off| self.byte(space, off) as u64);
        cache.execute(&call.desc, &ptrs).unwrap_or_else(|e| panic!("{e:#}"));
        let name = if call.desc.backward { "cudnn sdpa backward" } else { "cudnn sdpa forward" };
        self.launched.lock().expect("the launch record").insert(name.to_string());
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        sdpa_interpret::run(&call.desc, &ptrs, &mut m[..]).unwrap_or_else(|e| panic!("cuDNN's interpreter: {e:#}"));
    }

    fn capture(&mut self, slot: usize, work: &[Work]) -> anyhow::Result<()> {
        if self.graphs.len() <= slot {
            self.graphs.resize(slot + 1, Vec::new());
        }
        self.graphs[slot] = work.to_vec();
        Ok(())
    }

    fn replay(&self, slot: usize) -> anyhow::Result<()> {
        let graph = self.graphs.get(slot).ok_or_else(|| anyhow::anyhow!("no graph captured in slot {slot}"))?;
        for w in graph {
            self.run(w);
        }
        Ok(())
    }

    fn timing_mark(&self) -> Option<usize> {
        Some(self.marks.lock().expect("the timing marks").push(std::time::Instant::now()))
    }

    fn timing_ms(&self, from: usize, to: usize) -> anyhow::Result<f64> {
        let marks = self.marks.lock().expect("the timing marks");
        let (Some(a), Some(b)) = (marks.get(from), marks.get(to)) else { anyhow::bail!("no timing marks {from} and {to}") };
        Ok(b.duration_since(*a).as_secs_f64() * 1e3)
    }

    fn timing_reset(&self) {
        self.marks.lock().expect("the timing marks").clear();
    }

    fn timing_release(&self, mark: usize) {
        self.marks.lock().expect("the timing marks").release(mark);
    }

    fn read(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(!space.is_bf16(), "{space:?} is not a 4-byte space");
        // What a GPU's host read would wait for: a collective that was never joined.
        anyhow::ensure!(
            !self.comm.as_ref().is_some_and(|c| c.in_flight()),
            "a host read of {space:?}[{off}..] with collectives in flight (queued, never joined)"
        );
        Ok(self.words(space, off, len))
    }

    fn comm_init(&mut self, ranks: std::sync::Arc<dyn crate::dist::Collective>) -> anyhow::Result<()> {
        self.comm = Some(super::emu_comm::EmuComm::new(ranks));
        Ok(())
    }

    fn comm(&self, c: &super::CommCall) {
        let comm = self.comm.as_ref().unwrap_or_else(|| panic!("{c:?} queued before comm_init"));
        comm.run(self, c);
    }
}

impl EmuDevice {
    /// `len` words from element `off` of a 4-byte space.
    fn words(&self, space: Space, off: usize, len: usize) -> Vec<u32> {
        let at = self.byte(space, off + len) - len * 4;
        let m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        (0..len).map(|k| u32::from_ne_bytes(m[at + 4 * k..at + 4 * k + 4].try_into().expect("4 bytes"))).collect()
    }
}
