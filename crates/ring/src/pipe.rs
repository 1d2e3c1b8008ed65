//! A one-way frame pipe: a packed virtqueue plus a buffer pool in one region (memif-like).
//!
//! Layer: rings; the building block of the `shm` port (one pipe per direction). The **sender** is
//! the virtqueue's driver and owns the pool: it fills a free buffer, offers it as an available
//! descriptor (buffer id, offset 0, length), and reclaims it when the receiver (the device) marks it
//! used. Layout at `offset`: the virtqueue ([`crate::virtqueue::bytes_needed`]), then the pool.
//!
//! Distrust: the receiver checks every descriptor against the pool before reading a byte and copies
//! the frame out of shared memory before lending it; the sender accepts a used descriptor only for
//! a buffer it has in flight. A faulty peer therefore gets [`Error::Corrupt`], never an
//! out-of-bounds access. The one thing shared memory cannot prevent is a faulty peer scribbling on
//! a buffer the sender is filling: that corrupts only the frame the peer itself receives.

use std::sync::Arc;

use crate::copy::{store_fence, CopyMode};
use crate::virtqueue::{self, Device, Driver};
use crate::{Desc, Error, Pool, Region, Result};

/// The shape of a pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeConfig {
    /// Descriptors in the virtqueue (a power of two).
    pub slots: u16,
    /// Buffers in the pool (at least `slots` to keep the queue full).
    pub buffers: u32,
    /// Bytes per buffer (a multiple of 64, at least the largest frame).
    pub buf_size: u32,
}

impl PipeConfig {
    /// Bytes the pipe occupies in a region.
    pub fn bytes_needed(&self) -> usize {
        virtqueue::bytes_needed(self.slots) + crate::pool::bytes_needed(self.buffers, self.buf_size)
    }

    /// Writes an empty pipe at `offset` (64-aligned) in `region`; done by the region's creator.
    pub fn format(&self, region: &Region, offset: usize) -> Result<()> {
        virtqueue::format(region, offset, self.slots)?;
        Pool::format(region, offset + virtqueue::bytes_needed(self.slots), self.buffers, self.buf_size)
    }
}

/// The sending end (virtqueue driver, pool owner).
#[derive(Debug)]
pub struct Sender {
    driver: Driver,
    pool: Pool,
    free: Vec<u32>,
    in_flight: Vec<bool>,
    mode: CopyMode,
}

/// The receiving end (virtqueue device).
#[derive(Debug)]
pub struct Receiver {
    device: Device,
    pool: Pool,
    scratch: Vec<u8>,
}

fn pool_offset(region: &Region, offset: usize) -> Result<usize> {
    // The virtqueue's size is read and validated by attach; recompute its length from it.
    let base = region.range(offset, 8, 64)?;
    // SAFETY: inside the region (checked); volatile single fetch, validated by the attach calls.
    let size = unsafe { base.cast::<u32>().add(1).read_volatile() };
    let size = u16::try_from(size).map_err(|_| Error::Corrupt("virtqueue size too large"))?;
    Ok(offset + virtqueue::bytes_needed(size))
}

impl Sender {
    /// Attaches the sending end of a pipe formatted at `offset`; every buffer starts free.
    pub fn attach(region: Arc<Region>, offset: usize, mode: CopyMode) -> Result<Sender> {
        let driver = Driver::attach(region.clone(), offset)?;
        let pool = Pool::attach(region.clone(), pool_offset(&region, offset)?)?;
        let free = (0..pool.count()).rev().collect();
        let in_flight = vec![false; pool.count() as usize];
        Ok(Sender { driver, pool, free, in_flight, mode })
    }

    /// Takes back buffers the receiver has finished with; returns how many.
    pub fn reclaim(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some(d) = self.driver.poll_used()? {
            match self.in_flight.get_mut(d.buffer as usize) {
                Some(f) if *f => *f = false,
                _ => return Err(Error::Corrupt("receiver returned a buffer that was not in flight")),
            }
            self.free.push(d.buffer);
            n += 1;
        }
        Ok(n)
    }

    /// Sends one frame by letting `fill` write it into a free buffer (returning its length, or
    /// `None` to send nothing). Returns the length sent, `Ok(None)` when `fill` declined or no buffer
    /// or descriptor is free (call [`Sender::reclaim`] or wait).
    pub fn send_with(&mut self, fill: impl FnOnce(&mut [u8]) -> Option<usize>) -> Result<Option<usize>> {
        if self.free.is_empty() || self.driver.in_flight() == self.driver.size() {
            self.reclaim()?;
        }
        if self.driver.in_flight() == self.driver.size() {
            return Ok(None);
        }
        let Some(&buffer) = self.free.last() else { return Ok(None) };
        // SAFETY: `buffer` is in `free`: not offered to the receiver, so under the pipe protocol
        // nobody else accesses it, and this is the only slice of it alive.
        let buf = unsafe { self.pool.slice_mut(buffer, 0)? };
        let Some(len) = fill(buf) else { return Ok(None) };
        if len > self.pool.buf_size() as usize {
            return Err(Error::Misuse("fill returned a length longer than the buffer"));
        }
        self.free.pop();
        self.in_flight[buffer as usize] = true;
        let d = Desc { buffer, offset: 0, len: len as u32, ..Desc::default() };
        self.driver.add_avail(&d)?;
        Ok(Some(len))
    }

    /// Sends a copy of `frame` (with this pipe's copy mode). `Ok(false)` when full.
    pub fn send(&mut self, frame: &[u8]) -> Result<bool> {
        if frame.len() > self.pool.buf_size() as usize {
            return Err(Error::Misuse("frame longer than the pipe's buffers"));
        }
        let mode = self.mode;
        let sent = self.send_with(|buf| {
            // SAFETY: `buf` is at least frame.len() long (checked above) and private to us; the
            // fence right after orders non-temporal stores before add_avail's Release store.
            unsafe { crate::copy::copy_bytes(mode, buf.as_mut_ptr(), frame.as_ptr(), frame.len()) };
            store_fence(mode);
            Some(frame.len())
        })?;
        Ok(sent.is_some())
    }

    /// Whether the receiver is asleep and needs its doorbell rung (call after sending).
    pub fn wake_needed(&self) -> bool {
        self.driver.device_wake_needed()
    }

    /// The pool's buffer size: the largest frame this pipe carries.
    pub fn buf_size(&self) -> usize {
        self.pool.buf_size() as usize
    }
}

impl Receiver {
    /// Attaches the receiving end of a pipe formatted at `offset`.
    pub fn attach(region: Arc<Region>, offset: usize) -> Result<Receiver> {
        let device = Device::attach(region.clone(), offset)?;
        let pool = Pool::attach(region.clone(), pool_offset(&region, offset)?)?;
        let scratch = vec![0; pool.buf_size() as usize];
        Ok(Receiver { device, pool, scratch })
    }

    /// Receives one frame: copies it out of shared memory, returns the buffer to the sender, then
    /// lends the copy to `on_frame`. `Ok(false)` if nothing is waiting. A descriptor naming bytes
    /// outside the pool is returned unused and reported as [`Error::Corrupt`].
    pub fn recv(&mut self, on_frame: impl FnOnce(&[u8])) -> Result<bool> {
        let Some(d) = self.device.poll_avail()? else { return Ok(false) };
        let checked = self.pool.check(&d);
        if let Err(e) = checked {
            self.device.push_used(&Desc { len: 0, ..d })?;
            return Err(e);
        }
        let len = d.len as usize;
        self.pool.read(d.buffer, d.offset, &mut self.scratch[..len])?;
        self.device.push_used(&d)?;
        on_frame(&self.scratch[..len]);
        Ok(true)
    }

    /// Whether a frame is waiting (does not take it).
    pub fn has_pending(&self) -> bool {
        self.device.has_avail()
    }

    /// Announces the receiver will sleep; re-check [`Receiver::has_pending`] before sleeping.
    pub fn prepare_wait(&self) {
        self.device.prepare_wait()
    }

    /// Clears the wait flag after waking.
    pub fn finish_wait(&self) {
        self.device.finish_wait()
    }
}
