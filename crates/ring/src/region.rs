//! Memory regions for rings and buffer pools: anonymous (one process) or memfd-backed (shared).
//!
//! Layer: rings. A [`Region`] is a page-aligned, zero-filled mapping that lives as long as the
//! last `Arc<Region>` holding it. A memfd-backed region can be handed to another process over a
//! Unix socket ([`send_fds`] / [`recv_fds`], `SCM_RIGHTS`, see unix(7)); the receiver maps it with
//! [`Region::from_fd`]. Everything inside a shared region may be rewritten by the peer at any time,
//! so the types built on it read each peer-written value once and validate it before use.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

use crate::{Error, Result};

/// A mapped, zero-initialised memory region.
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: the region is plain memory; every access to it goes through atomics or through the
// ownership protocols of the ring types, which are what make concurrent use sound.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only hands out raw pointers.
unsafe impl Sync for Region {}

fn round_to_page(len: usize) -> usize {
    let page = 4096;
    len.div_ceil(page).max(1) * page
}

impl Region {
    /// A private anonymous mapping of at least `len` bytes (rounded up to a page), zero-filled.
    pub fn anonymous(len: usize) -> Result<Region> {
        let len = round_to_page(len);
        // SAFETY: a fresh anonymous mapping aliases nothing; the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io("mmap anonymous", io::Error::last_os_error()));
        }
        Ok(Region { ptr: NonNull::new(ptr.cast()).expect("mmap returned null"), len, fd: None })
    }

    /// A shared mapping of at least `len` bytes backed by a new memfd named `name`, zero-filled.
    /// [`Region::fd`] gives the fd to pass to the peer.
    pub fn memfd(name: &str, len: usize) -> Result<Region> {
        let len = round_to_page(len);
        let cname = std::ffi::CString::new(name).map_err(|_| Error::Misuse("memfd name contains NUL"))?;
        // SAFETY: `cname` is a valid C string; the returned fd is checked.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::io("memfd_create", io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscall on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::io("ftruncate memfd", io::Error::last_os_error()));
        }
        // A peer that shrank the file would make every access beyond its new end a SIGBUS here:
        // the size is sealed before the fd is shared.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: plain fcntl on an fd we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::io("seal memfd", io::Error::last_os_error()));
        }
        Self::map_shared(fd, len)
    }

    /// Maps a region received from a peer. Its size is the fd's size; the caller validates the
    /// contents (every type in this crate does so in its `attach`).
    pub fn from_fd(fd: OwnedFd) -> Result<Region> {
        // SAFETY: `st` is plain data that fstat fills in; the return value is checked.
        let mut st: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: valid fd and a valid pointer to a stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io("fstat shared fd", io::Error::last_os_error()));
        }
        let len = usize::try_from(st.st_size).unwrap_or(0);
        if len == 0 || len > (1 << 40) {
            return Err(Error::Corrupt("shared memory fd has an implausible size"));
        }
        Self::map_shared(fd, len)
    }

    fn map_shared(fd: OwnedFd, len: usize) -> Result<Region> {
        // SAFETY: maps `len` bytes of a file we hold; the result is checked. The file's size is at
        // least `len` (we set it, or fstat reported it).
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io("mmap shared", io::Error::last_os_error()));
        }
        Ok(Region { ptr: NonNull::new(ptr.cast()).expect("mmap returned null"), len, fd: Some(fd) })
    }

    /// The start of the mapping (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memfd to pass to a peer, for a shared region.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Checks that `[offset, offset + len)` lies inside the region and `offset` is aligned to
    /// `align` (a power of two), returning the pointer to `offset`.
    pub fn range(&self, offset: usize, len: usize, align: usize) -> Result<*mut u8> {
        let end = offset.checked_add(len).ok_or(Error::Corrupt("region range overflows"))?;
        if end > self.len {
            return Err(Error::Corrupt("range lies outside the shared region"));
        }
        if !offset.is_multiple_of(align) {
            return Err(Error::Corrupt("misaligned offset in the shared region"));
        }
        // SAFETY: `offset <= end <= len`, so the pointer stays inside (or one past) the mapping.
        Ok(unsafe { self.as_ptr().add(offset) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly `ptr..ptr+len` and nothing borrows it any more (every user
        // holds an `Arc<Region>`, and this is the last one).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The process at the other end of a Unix socket, as the kernel recorded it when it connected
/// (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its process id.
    pub pid: i32,
    /// Its effective user id.
    pub uid: u32,
    /// Its effective group id.
    pub gid: u32,
}

/// The credentials of the process at the other end of `sock`.
pub fn peer_cred(sock: &UnixStream) -> Result<PeerCred> {
    // SAFETY: ucred is plain data; zero is a valid initial value.
    let mut cred: libc::ucred = unsafe { core::mem::zeroed() };
    let mut len = core::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and sized for SO_PEERCRED's answer.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Error::io("getsockopt SO_PEERCRED", io::Error::last_os_error()));
    }
    Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// Most fds [`recv_fds`] accepts in one message.
pub const MAX_FDS: usize = 4;

/// Sends `bytes` (at least one) with `fds` attached as `SCM_RIGHTS` over a Unix stream socket.
pub fn send_fds(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if bytes.is_empty() || fds.len() > MAX_FDS {
        return Err(Error::Misuse("send_fds needs 1.. bytes and at most MAX_FDS fds"));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = core::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; zero is a valid initial value.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to `space` bytes, enough for one header with `payload` bytes
        // of data (CMSG_SPACE), so CMSG_FIRSTHDR is non-null and CMSG_DATA has room for `raw`.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
            core::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), raw.len());
        }
    }
    // SAFETY: msg points to live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(Error::io("sendmsg SCM_RIGHTS", io::Error::last_os_error()));
    }
    if n as usize != bytes.len() {
        return Err(Error::io("sendmsg SCM_RIGHTS", io::Error::other("short send")));
    }
    Ok(())
}

/// Receives one message into `buf` with up to [`MAX_FDS`] fds. Returns the byte count and the fds
/// (each closed when dropped). A message whose control data was truncated is an error.
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    let payload = MAX_FDS * core::mem::size_of::<RawFd>();
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; zero is a valid initial value.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points to live buffers; MSG_CMSG_CLOEXEC keeps received fds from leaking to exec.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::io("recvmsg SCM_RIGHTS", io::Error::last_os_error()));
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_FIRSTHDR/NXTHDR walk only inside
    // that buffer and return null at its end. Each SCM_RIGHTS fd is new and owned by us from here.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let count = data_len / core::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::Corrupt("peer sent more fds than expected"));
    }
    Ok((n as usize, fds))
}
