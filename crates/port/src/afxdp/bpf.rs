//! The XDP side of the AF_XDP port: a hand-assembled eBPF program, the XSKMAP it redirects into,
//! and the attachment to an interface, all through the kernel's `bpf(2)` system call (no clang,
//! no libbpf).
//!
//! Layer: ports (kernel interface). The program implements the one rule the port needs: it
//! redirects only EtherType 0x88B5 frames (untagged, or behind one 802.1Q tag, for groups carried
//! as VLANs) to the socket and passes everything else to the kernel:
//!
//! ```text
//!  0: r2 = *(u32 *)(r1 + 4)        ; xdp_md.data_end
//!  1: r3 = *(u32 *)(r1 + 0)        ; xdp_md.data
//!  2: r4 = r3
//!  3: r4 += 14                     ; end of the Ethernet header
//!  4: if r4 > r2 goto pass         ; bounds check the verifier insists on
//!  5: r4 = *(u16 *)(r3 + 12)       ; EtherType, network byte order as loaded
//!  6: if r4 == 0x88B5 goto redirect ; (compared in the host's load order)
//!  7: if r4 != 0x8100 goto pass    ; an 802.1Q tag?
//!  8: r4 = r3
//!  9: r4 += 18                     ; end of the tagged header
//! 10: if r4 > r2 goto pass
//! 11: r4 = *(u16 *)(r3 + 16)       ; the EtherType behind the tag
//! 12: if r4 != 0x88B5 goto pass
//! 13: redirect: r2 = *(u32 *)(r1 + 16) ; xdp_md.rx_queue_index: the key
//! 14: r1 = map_fd xsks_map         ; ld_imm64, src = BPF_PSEUDO_MAP_FD (two slots)
//! 16: r3 = XDP_PASS                ; flags: the action when the queue has no socket
//! 17: call bpf_redirect_map
//! 18: exit
//! 19: pass: r0 = XDP_PASS
//! 20: exit
//! ```
//!
//! Invariants: every file descriptor is owned ([`OwnedFd`]) and closed on drop; the program is
//! attached through a BPF link, so it is detached when the link is closed, even if the process
//! dies, and attaching never replaces a program someone else put on the interface (the kernel
//! refuses with `EBUSY`/`EEXIST`, which we report). Instruction layout follows
//! `include/uapi/linux/bpf.h` (`struct bpf_insn`, `union bpf_attr`) and
//! `Documentation/bpf/standardization/instruction-set.rst`.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The lanbus EtherType the program redirects.
pub const ETHERTYPE_LANBUS: u16 = 0x88B5;
/// The 802.1Q tag's protocol identifier.
pub const ETHERTYPE_VLAN: u16 = 0x8100;

/// XDP verdicts (`enum xdp_action`).
pub mod action {
    /// Drop the frame.
    pub const XDP_ABORTED: u32 = 0;
    /// Drop the frame.
    pub const XDP_DROP: u32 = 1;
    /// Hand the frame to the kernel's stack.
    pub const XDP_PASS: u32 = 2;
    /// Send the frame back out of the interface.
    pub const XDP_TX: u32 = 3;
    /// Redirect (here: to an AF_XDP socket).
    pub const XDP_REDIRECT: u32 = 4;
}

// Opcode parts (instruction-set.rst, "Instruction classes" and "Arithmetic and jump").
const BPF_LD: u8 = 0x00;
const BPF_LDX: u8 = 0x01;
const BPF_JMP: u8 = 0x05;
const BPF_ALU64: u8 = 0x07;
const BPF_W: u8 = 0x00;
const BPF_H: u8 = 0x08;
const BPF_DW: u8 = 0x18;
const BPF_IMM: u8 = 0x00;
const BPF_MEM: u8 = 0x60;
const BPF_K: u8 = 0x00;
const BPF_X: u8 = 0x08;
const BPF_ADD: u8 = 0x00;
const BPF_MOV: u8 = 0xb0;
const BPF_JGT: u8 = 0x20;
const BPF_JNE: u8 = 0x50;
const BPF_JEQ: u8 = 0x10;
const BPF_CALL: u8 = 0x80;
const BPF_EXIT: u8 = 0x90;
/// `src_reg` of an `ld_imm64` whose immediate is a map file descriptor.
const BPF_PSEUDO_MAP_FD: u8 = 1;
/// `enum bpf_func_id`: `long bpf_redirect_map(void *map, u64 key, u64 flags)`.
const BPF_FUNC_REDIRECT_MAP: i32 = 51;

/// `struct xdp_md` field offsets.
const XDP_MD_DATA: i16 = 0;
const XDP_MD_DATA_END: i16 = 4;
const XDP_MD_RX_QUEUE_INDEX: i16 = 16;

/// An eBPF register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reg(u8);

/// Return value / scratch.
pub const R0: Reg = Reg(0);
/// First argument (the `xdp_md` context on entry).
pub const R1: Reg = Reg(1);
/// Second argument.
pub const R2: Reg = Reg(2);
/// Third argument.
pub const R3: Reg = Reg(3);
/// Scratch.
pub const R4: Reg = Reg(4);

/// One 8-byte eBPF instruction, laid out as the kernel's `struct bpf_insn`
/// (`u8 code; u8 dst_reg:4, src_reg:4; s16 off; s32 imm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: Reg, src: Reg, off: i16, imm: i32) -> Insn {
        // C bitfields are allocated from the low bit on little-endian targets and from the high
        // bit on big-endian ones, so `dst_reg` is the low nibble only on little-endian.
        let regs = if cfg!(target_endian = "little") { dst.0 | (src.0 << 4) } else { (dst.0 << 4) | src.0 };
        Insn { code, regs, off, imm }
    }

    /// `dst = *(size *)(src + off)` with `size` one of `BPF_W`, `BPF_H`.
    const fn load(size: u8, dst: Reg, src: Reg, off: i16) -> Insn {
        Insn::new(BPF_LDX | BPF_MEM | size, dst, src, off, 0)
    }

    /// `dst = *(u32 *)(src + off)`.
    pub const fn load_u32(dst: Reg, src: Reg, off: i16) -> Insn {
        Insn::load(BPF_W, dst, src, off)
    }

    /// `dst = *(u16 *)(src + off)`.
    pub const fn load_u16(dst: Reg, src: Reg, off: i16) -> Insn {
        Insn::load(BPF_H, dst, src, off)
    }

    /// `dst = src` (64-bit).
    pub const fn mov_reg(dst: Reg, src: Reg) -> Insn {
        Insn::new(BPF_ALU64 | BPF_MOV | BPF_X, dst, src, 0, 0)
    }

    /// `dst = imm` (64-bit, sign-extended).
    pub const fn mov_imm(dst: Reg, imm: i32) -> Insn {
        Insn::new(BPF_ALU64 | BPF_MOV | BPF_K, dst, Reg(0), 0, imm)
    }

    /// `dst += imm` (64-bit).
    pub const fn add_imm(dst: Reg, imm: i32) -> Insn {
        Insn::new(BPF_ALU64 | BPF_ADD | BPF_K, dst, Reg(0), 0, imm)
    }

    /// `if dst > src goto +off` (unsigned).
    pub const fn jgt_reg(dst: Reg, src: Reg, off: i16) -> Insn {
        Insn::new(BPF_JMP | BPF_JGT | BPF_X, dst, src, off, 0)
    }

    /// `if dst != imm goto +off`.
    pub const fn jne_imm(dst: Reg, imm: i32, off: i16) -> Insn {
        Insn::new(BPF_JMP | BPF_JNE | BPF_K, dst, Reg(0), off, imm)
    }

    /// `if dst == imm goto +off`.
    pub const fn jeq_imm(dst: Reg, imm: i32, off: i16) -> Insn {
        Insn::new(BPF_JMP | BPF_JEQ | BPF_K, dst, Reg(0), off, imm)
    }

    /// `call helper`.
    pub const fn call(helper: i32) -> Insn {
        Insn::new(BPF_JMP | BPF_CALL, Reg(0), Reg(0), 0, helper)
    }

    /// `exit` (return `r0`).
    pub const fn exit() -> Insn {
        Insn::new(BPF_JMP | BPF_EXIT, Reg(0), Reg(0), 0, 0)
    }

    /// `dst = map` from a map file descriptor: the two-slot `ld_imm64` the kernel rewrites into the
    /// map's address at load time.
    pub const fn load_map_fd(dst: Reg, map_fd: i32) -> [Insn; 2] {
        [
            Insn::new(BPF_LD | BPF_IMM | BPF_DW, dst, Reg(BPF_PSEUDO_MAP_FD), 0, map_fd),
            Insn::new(0, Reg(0), Reg(0), 0, 0),
        ]
    }

    /// The instruction's 8 bytes as the kernel reads them on this machine.
    pub fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.code;
        b[1] = self.regs;
        b[2..4].copy_from_slice(&self.off.to_ne_bytes());
        b[4..8].copy_from_slice(&self.imm.to_ne_bytes());
        b
    }
}

/// A forward jump target in [`Assembler`].
#[derive(Debug, Clone, Copy)]
struct Label(usize);

/// A tiny assembler: appends instructions and patches forward jumps to labels.
#[derive(Debug, Default)]
struct Assembler {
    insns: Vec<Insn>,
    /// (index of a jump instruction, label it goes to)
    fixups: Vec<(usize, Label)>,
    /// Position of each label, once placed.
    labels: Vec<Option<usize>>,
}

impl Assembler {
    fn emit(&mut self, insns: &[Insn]) {
        self.insns.extend_from_slice(insns);
    }
    fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }
    fn emit_jump(&mut self, insn: Insn, to: Label) {
        self.fixups.push((self.insns.len(), to));
        self.insns.push(insn);
    }
    fn place(&mut self, label: Label) {
        self.labels[label.0] = Some(self.insns.len());
    }
    fn finish(mut self) -> Vec<Insn> {
        for (at, label) in self.fixups {
            let target = self.labels[label.0].expect("every label used is placed");
            // Jump offsets count instructions from the one after the jump.
            self.insns[at].off = i16::try_from(target as isize - at as isize - 1).expect("short program");
        }
        self.insns
    }
}

/// The port's XDP program: lanbus frames go to the AF_XDP socket registered in `xsks_map_fd` at
/// the frame's receive queue, everything else (and lanbus frames on a queue without a socket)
/// goes to the kernel.
pub fn lanbus_redirect_program(xsks_map_fd: RawFd) -> Vec<Insn> {
    let mut asm = Assembler::default();
    let pass = asm.label();
    let redirect = asm.label();
    asm.emit(&[
        Insn::load_u32(R2, R1, XDP_MD_DATA_END),
        Insn::load_u32(R3, R1, XDP_MD_DATA),
        Insn::mov_reg(R4, R3),
        Insn::add_imm(R4, 14),
    ]);
    asm.emit_jump(Insn::jgt_reg(R4, R2, 0), pass);
    asm.emit(&[Insn::load_u16(R4, R3, 12)]);
    // The load keeps the wire's byte order in memory, so compare against the value the same two
    // bytes have when loaded on this machine.
    let as_loaded = |ethertype: u16| i32::from(u16::from_ne_bytes(ethertype.to_be_bytes()));
    let lanbus_as_loaded = as_loaded(ETHERTYPE_LANBUS);
    asm.emit_jump(Insn::jeq_imm(R4, lanbus_as_loaded, 0), redirect);
    asm.emit_jump(Insn::jne_imm(R4, as_loaded(ETHERTYPE_VLAN), 0), pass);
    asm.emit(&[Insn::mov_reg(R4, R3), Insn::add_imm(R4, 18)]);
    asm.emit_jump(Insn::jgt_reg(R4, R2, 0), pass);
    asm.emit(&[Insn::load_u16(R4, R3, 16)]);
    asm.emit_jump(Insn::jne_imm(R4, lanbus_as_loaded, 0), pass);
    asm.place(redirect);
    asm.emit(&[Insn::load_u32(R2, R1, XDP_MD_RX_QUEUE_INDEX)]);
    asm.emit(&Insn::load_map_fd(R1, xsks_map_fd));
    asm.emit(&[Insn::mov_imm(R3, action::XDP_PASS as i32), Insn::call(BPF_FUNC_REDIRECT_MAP), Insn::exit()]);
    asm.place(pass);
    asm.emit(&[Insn::mov_imm(R0, action::XDP_PASS as i32), Insn::exit()]);
    asm.finish()
}

// `enum bpf_cmd`.
const BPF_MAP_CREATE: i32 = 0;
const BPF_MAP_UPDATE_ELEM: i32 = 2;
const BPF_PROG_LOAD: i32 = 5;
const BPF_PROG_TEST_RUN: i32 = 10;
const BPF_LINK_CREATE: i32 = 28;
const BPF_LINK_DETACH: i32 = 34;
// `enum bpf_map_type`, `enum bpf_prog_type`, `enum bpf_attach_type`.
const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
// `XDP_FLAGS_*` (include/uapi/linux/if_link.h).
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// The `bpf(2)` system call. Returns the non-negative result or the OS error.
///
/// # Safety
/// `attr` must point to `size` readable (and, for commands that write back, writable) bytes laid
/// out as the `union bpf_attr` member `cmd` expects, and every pointer inside it must be valid for
/// the lengths it states for the duration of the call.
unsafe fn sys_bpf(cmd: i32, attr: *mut c_void, size: usize) -> io::Result<i64> {
    // SAFETY: forwarded to the caller's contract; the kernel reads at most `size` bytes of `attr`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size as u32) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn fd_from(rc: i64) -> OwnedFd {
    // SAFETY: the bpf commands that return file descriptors return a new descriptor owned by the
    // caller; nothing else holds it.
    unsafe { OwnedFd::from_raw_fd(rc as RawFd) }
}

fn object_name(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    let n = name.len().min(15);
    out[..n].copy_from_slice(&name.as_bytes()[..n]);
    out
}

/// `union bpf_attr` for `BPF_MAP_CREATE`.
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// Creates an XSKMAP (queue index to AF_XDP socket) with `max_entries` slots.
pub fn create_xskmap(max_entries: u32) -> io::Result<OwnedFd> {
    let mut attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_XSKMAP,
        key_size: 4,
        value_size: 4,
        max_entries,
        map_name: object_name("lanbus_xsks"),
        ..Default::default()
    };
    // SAFETY: `attr` is a live, fully initialised MAP_CREATE attribute of the size passed.
    let fd = unsafe { sys_bpf(BPF_MAP_CREATE, (&raw mut attr).cast(), size_of::<MapCreateAttr>())? };
    Ok(fd_from(fd))
}

/// `union bpf_attr` for `BPF_MAP_*_ELEM`.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Sets `map[key] = value` for a map with 4-byte keys and values (an XSKMAP takes a socket fd).
pub fn map_update_u32(map: &OwnedFd, key: u32, value: u32) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: (&raw const key) as u64,
        value: (&raw const value) as u64,
        flags: 0, // BPF_ANY
    };
    // SAFETY: the attribute points at `key` and `value`, which outlive the call and have the map's
    // key and value sizes.
    unsafe { sys_bpf(BPF_MAP_UPDATE_ELEM, (&raw mut attr).cast(), size_of::<MapElemAttr>())? };
    Ok(())
}

/// `union bpf_attr` for `BPF_PROG_LOAD`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// Why a program did not load.
#[derive(Debug)]
pub struct LoadError {
    /// The kernel's error.
    pub source: io::Error,
    /// The verifier's log (empty if the kernel gave none).
    pub log: String,
}

/// `BPF_F_XDP_HAS_FRAGS`: the program copes with frames in several buffers (it reads only the
/// first bytes, which are always in the first), so the interface may take frames larger than a
/// page.
const BPF_F_XDP_HAS_FRAGS: u32 = 1 << 5;

/// Loads an XDP program (declared able to handle multi-buffer frames when `frags`: Linux 5.18+).
/// On failure, loads it again with the verifier log enabled and returns the log with the error.
pub fn load_xdp_program(insns: &[Insn], name: &str, frags: bool) -> Result<OwnedFd, LoadError> {
    const LICENSE: &[u8] = b"Dual MIT/GPL\0";
    let load = |log: Option<&mut Vec<u8>>| -> io::Result<OwnedFd> {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_XDP,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: LICENSE.as_ptr() as u64,
            prog_name: object_name(name),
            expected_attach_type: BPF_XDP,
            prog_flags: if frags { BPF_F_XDP_HAS_FRAGS } else { 0 },
            ..Default::default()
        };
        if let Some(buf) = log {
            attr.log_level = 1;
            attr.log_size = buf.len() as u32;
            attr.log_buf = buf.as_mut_ptr() as u64;
        }
        // SAFETY: `insns` (repr(C) bpf_insn, insn_cnt of them), the NUL-terminated license and the
        // log buffer (log_size bytes, writable) all outlive the call.
        let fd = unsafe { sys_bpf(BPF_PROG_LOAD, (&raw mut attr).cast(), size_of::<ProgLoadAttr>())? };
        Ok(fd_from(fd))
    };
    match load(None) {
        Ok(fd) => Ok(fd),
        Err(first) => {
            let mut buf = vec![0u8; 64 * 1024];
            let again = load(Some(&mut buf));
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            let log = String::from_utf8_lossy(&buf[..end]).trim().to_string();
            match again {
                // Loading is deterministic, so this is not expected; keep the program anyway.
                Ok(fd) => Ok(fd),
                Err(_) => Err(LoadError { source: first, log }),
            }
        }
    }
}

/// `union bpf_attr` for `BPF_PROG_TEST_RUN`.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
}

/// Runs an XDP program once on `frame` in the kernel (`BPF_PROG_TEST_RUN`, receive queue 0 of
/// the namespace's loopback device) and returns its verdict.
pub fn test_run_xdp(prog: &OwnedFd, frame: &[u8]) -> io::Result<u32> {
    let mut attr = TestRunAttr {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_in: frame.as_ptr() as u64,
        repeat: 1,
        ..Default::default()
    };
    // SAFETY: `frame` is readable for data_size_in bytes; no output buffers are given.
    unsafe { sys_bpf(BPF_PROG_TEST_RUN, (&raw mut attr).cast(), size_of::<TestRunAttr>())? };
    Ok(attr.retval)
}

/// Where an XDP program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// In the driver, before any socket buffer is allocated (veth and most server NICs).
    Native,
    /// In the generic path after the socket buffer is built: works on every interface, slower.
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Native => XDP_FLAGS_DRV_MODE,
            XdpMode::Generic => XDP_FLAGS_SKB_MODE,
        }
    }
}

/// `union bpf_attr` for `BPF_LINK_CREATE` (and the first word for `BPF_LINK_DETACH`).
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// An XDP program attached to an interface through a BPF link: detached on drop.
#[derive(Debug)]
pub struct XdpLink {
    link: OwnedFd,
    mode: XdpMode,
}

impl XdpLink {
    /// Attaches `prog` to interface `ifindex` (of the calling thread's network namespace) in
    /// `mode`. Fails with `EBUSY` or `EEXIST` when the interface already has an XDP program, and
    /// with `EOPNOTSUPP` when the driver has no native XDP.
    pub fn attach(prog: &OwnedFd, ifindex: u32, mode: XdpMode) -> io::Result<XdpLink> {
        let mut attr = LinkCreateAttr {
            prog_fd: prog.as_raw_fd() as u32,
            target_ifindex: ifindex,
            attach_type: BPF_XDP,
            flags: mode.flags(),
        };
        // SAFETY: `attr` is a live LINK_CREATE attribute of the size passed.
        let fd = unsafe { sys_bpf(BPF_LINK_CREATE, (&raw mut attr).cast(), size_of::<LinkCreateAttr>())? };
        Ok(XdpLink { link: fd_from(fd), mode })
    }

    /// The mode the program runs in.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }
}

impl Drop for XdpLink {
    fn drop(&mut self) {
        // Closing the last reference to the link detaches the program too; detaching explicitly
        // first makes the interface clean by the time drop returns even if someone else holds a
        // duplicate of the link fd.
        let mut attr = LinkCreateAttr { prog_fd: self.link.as_raw_fd() as u32, ..Default::default() };
        // SAFETY: `attr` is live; LINK_DETACH reads only its first word (link_fd).
        let _ = unsafe { sys_bpf(BPF_LINK_DETACH, (&raw mut attr).cast(), size_of::<LinkCreateAttr>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(insns: &[Insn]) -> Vec<[u8; 8]> {
        insns.iter().map(|i| i.to_bytes()).collect()
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn instructions_encode_as_the_kernel_reads_them() {
        // Expected bytes written out from instruction-set.rst (opcode, dst | src << 4, off, imm).
        assert_eq!(Insn::mov_imm(R0, 2).to_bytes(), [0xb7, 0x00, 0, 0, 2, 0, 0, 0]);
        assert_eq!(Insn::exit().to_bytes(), [0x95, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Insn::load_u32(R2, R1, 4).to_bytes(), [0x61, 0x12, 4, 0, 0, 0, 0, 0]);
        assert_eq!(Insn::load_u16(R4, R3, 12).to_bytes(), [0x69, 0x34, 12, 0, 0, 0, 0, 0]);
        assert_eq!(Insn::mov_reg(R4, R3).to_bytes(), [0xbf, 0x34, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Insn::add_imm(R4, 14).to_bytes(), [0x07, 0x04, 0, 0, 14, 0, 0, 0]);
        assert_eq!(Insn::jgt_reg(R4, R2, 8).to_bytes(), [0x2d, 0x24, 8, 0, 0, 0, 0, 0]);
        assert_eq!(Insn::jne_imm(R4, 0xB588, -3).to_bytes(), [0x55, 0x04, 0xfd, 0xff, 0x88, 0xb5, 0, 0]);
        assert_eq!(Insn::call(51).to_bytes(), [0x85, 0, 0, 0, 51, 0, 0, 0]);
        let ld = Insn::load_map_fd(R1, 7);
        assert_eq!(bytes(&ld), vec![[0x18, 0x11, 0, 0, 7, 0, 0, 0], [0; 8]]);
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn redirect_program_matches_its_listing() {
        let prog = lanbus_redirect_program(9);
        assert_eq!(
            bytes(&prog),
            vec![
                [0x61, 0x12, 4, 0, 0, 0, 0, 0],       // r2 = data_end
                [0x61, 0x13, 0, 0, 0, 0, 0, 0],       // r3 = data
                [0xbf, 0x34, 0, 0, 0, 0, 0, 0],       // r4 = r3
                [0x07, 0x04, 0, 0, 14, 0, 0, 0],      // r4 += 14
                [0x2d, 0x24, 14, 0, 0, 0, 0, 0],      // if r4 > r2 goto pass (4 + 1 + 14 = 19)
                [0x69, 0x34, 12, 0, 0, 0, 0, 0],      // r4 = ethertype
                [0x15, 0x04, 6, 0, 0x88, 0xb5, 0, 0], // if r4 == 0x88B5 (as loaded) goto redirect
                [0x55, 0x04, 11, 0, 0x81, 0, 0, 0],   // if r4 != 0x8100 goto pass
                [0xbf, 0x34, 0, 0, 0, 0, 0, 0],       // r4 = r3
                [0x07, 0x04, 0, 0, 18, 0, 0, 0],      // r4 += 18
                [0x2d, 0x24, 8, 0, 0, 0, 0, 0],       // if r4 > r2 goto pass
                [0x69, 0x34, 16, 0, 0, 0, 0, 0],      // r4 = the ethertype behind the tag
                [0x55, 0x04, 6, 0, 0x88, 0xb5, 0, 0], // if r4 != 0x88B5 goto pass
                [0x61, 0x12, 16, 0, 0, 0, 0, 0],      // redirect: r2 = rx_queue_index
                [0x18, 0x11, 0, 0, 9, 0, 0, 0],       // r1 = map fd 9
                [0; 8],                               // (second half of ld_imm64)
                [0xb7, 0x03, 0, 0, 2, 0, 0, 0],       // r3 = XDP_PASS
                [0x85, 0, 0, 0, 51, 0, 0, 0],         // call bpf_redirect_map
                [0x95, 0, 0, 0, 0, 0, 0, 0],          // exit
                [0xb7, 0x00, 0, 0, 2, 0, 0, 0],       // pass: r0 = XDP_PASS
                [0x95, 0, 0, 0, 0, 0, 0, 0],          // exit
            ]
        );
    }

    #[test]
    fn jumps_land_on_their_labels() {
        let prog = lanbus_redirect_program(3);
        let pass = prog.len() - 2;
        let redirect = 13;
        for (at, insn) in prog.iter().enumerate() {
            if insn.code & 0x07 == BPF_JMP && insn.code & 0xf0 != BPF_CALL && insn.code & 0xf0 != BPF_EXIT {
                let to = at as isize + 1 + insn.off as isize;
                let want = if insn.code & 0xf0 == BPF_JEQ { redirect } else { pass };
                assert_eq!(to, want as isize, "jump at {at}");
            }
        }
        assert_eq!(prog[redirect], Insn::load_u32(R2, R1, XDP_MD_RX_QUEUE_INDEX));
        assert_eq!(prog[pass], Insn::mov_imm(R0, action::XDP_PASS as i32));
    }

    #[test]
    fn attribute_layouts_match_the_kernel() {
        // Sizes up to the last field each command uses, from include/uapi/linux/bpf.h.
        assert_eq!(size_of::<Insn>(), 8);
        assert_eq!(size_of::<MapCreateAttr>(), 44);
        assert_eq!(size_of::<MapElemAttr>(), 32);
        assert_eq!(size_of::<ProgLoadAttr>(), 72);
        assert_eq!(core::mem::offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(core::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(core::mem::offset_of!(TestRunAttr, ctx_in), 48);
        assert_eq!(size_of::<LinkCreateAttr>(), 16);
    }
}
