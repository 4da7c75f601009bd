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

use super::{Arg, Device, Launch, Sizes, Space, Work};
use crate::engine::lt::{self, LtPlan};

/// Builds the emulator into `dir/name`, with `engine_source` in place of kernels/engine.cu.
pub(super) fn build(dir: &Path, name: &str, engine_source: Option<&Path>) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(dir).expect("temp dir is writable");
    let exe = dir.join(name);
    let mut cmd = Command::new("g++");
    cmd.args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-o"]).arg(&exe);
    // The emulator's stand-ins for CUDA's headers first; then kernels/, for the ops' shared
    // device maths (`#include "ops/..."`) of a copy of engine.cu outside it.
    cmd.arg("-I").arg(root.join("tests/warp_emu/include"));
    cmd.arg("-I").arg(root.join("kernels"));
    if let Some(src) = engine_source {
        cmd.arg(format!("-DENGINE_SOURCE=\"{}\"", src.display()));
    }
    let out = cmd
        .arg(root.join("tests/warp_emu/engine_emu.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run g++ (the warp emulator needs a C++20 compiler): {e}"));
    assert!(out.status.success(), "g++ failed on the engine's emulator:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// A copy of kernels/engine.cu and its headers (kernels/ops/) in `dir/name/`, with `from`
/// replaced by `to` in `file` (a path under kernels/, where `from` must occur once): a kernel
/// broken on purpose, for [`build`]'s `engine_source`. Returns the copy of engine.cu, whose
/// `#include "ops/..."` then finds the copied headers next to it.
pub(super) fn mutant(dir: &Path, name: &str, file: &str, from: &str, to: &str) -> PathBuf {
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let copy = dir.join(name);
    std::fs::create_dir_all(copy.join("ops")).expect("temp dir is writable");
    let mut files = vec![PathBuf::from("engine.cu")];
    for e in std::fs::read_dir(kernels.join("ops")).expect("kernels/ops exists") {
        files.push(Path::new("ops").join(e.expect("kernels/ops is readable").file_name()));
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
    assert!(mutated, "kernels/{file} is not engine.cu or a header of kernels/ops");
    copy.join("engine.cu")
}

/// A directory of this test process for the emulator's files.
pub(super) fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("pipeline-engine-emu-{}", std::process::id()))
}

/// The emulator of the project's kernels, built once per test process.
pub(super) fn emulator() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build(&temp_dir(), "engine_emu", None))
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
    launched: Mutex<std::collections::BTreeSet<String>>,
    /// GEMMs with their inputs rounded to bf16 (the GPU's default maths), else in f32.
    bf16_gemms: bool,
    /// Timing marks: the emulator finishes each launch before the host goes on, so the host's
    /// clock at a mark is the device's.
    marks: Mutex<super::Marks<std::time::Instant>>,
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
            launched: Mutex::new(Default::default()),
            bf16_gemms: false,
            marks: Mutex::new(super::Marks::default()),
        }
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

    /// Byte offset of element `off` of `space`, checked.
    fn byte(&self, space: Space, off: usize) -> usize {
        let &(_, base, len) = self.spaces.iter().find(|s| s.0 == space).expect("the device is allocated");
        assert!(off <= len, "element {off} outside the {len}-element {space:?} space");
        base + off * space.elem_bytes()
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
            };
            self.spaces.push((s, bytes, len));
            bytes += (len * s.elem_bytes()).div_ceil(256) * 256;
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

    fn gemm(&self, plan: &LtPlan) {
        let base = self.byte(Space::Arena, 0);
        let len = self.spaces[0].2;
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        let bytes = &mut m[base..base + len * 4];
        // SAFETY: the arena's bytes are 4-aligned (the map is page-aligned, the arena first) and
        // any bit pattern is an f32.
        let arena = unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut f32, len) };
        lt::interpret_rounding(plan, arena, self.bf16_gemms);
    }

    fn write(&mut self, space: Space, off: usize, words: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(space != Space::Half, "the bf16 space is not written from the host");
        let at = self.byte(space, off + words.len()) - words.len() * 4;
        let mut m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        for (k, w) in words.iter().enumerate() {
            m[at + 4 * k..at + 4 * k + 4].copy_from_slice(&w.to_ne_bytes());
        }
        Ok(())
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
        anyhow::ensure!(space != Space::Half, "the bf16 space is not read from the host");
        let at = self.byte(space, off + len) - len * 4;
        let m = self.memory.as_ref().expect("the device is allocated").lock().expect("the memory lock");
        Ok((0..len).map(|k| u32::from_ne_bytes(m[at + 4 * k..at + 4 * k + 4].try_into().expect("4 bytes"))).collect())
    }
}
