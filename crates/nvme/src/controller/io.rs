//! The NVM command set (device side): execution of I/O commands, as a second `impl Controller`
//! block. NVMe base specification 1.4 section 6: Read and Write (with FUA), Flush, Write Zeroes
//! (with Deallocate) and Dataset Management (the Deallocate attribute), against the namespace's
//! [`Backing`](crate::backing::Backing) store; data moves through the command's PRPs (section
//! 4.3) with the controller's DMA helpers.

use super::Controller;
use crate::command::{decode_io, IoCommand, Sqe};
use crate::status::Status;
use crate::HostMemory;

impl Controller {
    fn check_range(&self, slba: u64, blocks: u64) -> Result<(), Status> {
        match slba.checked_add(blocks) {
            Some(end) if end <= self.blocks => Ok(()),
            _ => Err(Status::LBA_OUT_OF_RANGE),
        }
    }

    /// Executes I/O command `sqe`: `Ok(Some(dw0))` completes it with success and that DW0, `Err`
    /// completes it with that status.
    pub(super) fn exec_io(&mut self, sqe: &Sqe, mem: &mut dyn HostMemory) -> Result<Option<u32>, Status> {
        let lba = u64::from(self.cfg.lba_size);
        match decode_io(sqe)? {
            IoCommand::ReadWrite { write, nsid, slba, blocks, fua, data } => {
                self.check_nsid(nsid)?;
                self.check_range(slba, u64::from(blocks))?;
                let len = blocks as usize * self.cfg.lba_size as usize;
                if len > self.mdts_bytes() {
                    return Err(Status::INVALID_FIELD);
                }
                if self.data.len() < len {
                    self.data.resize(len, 0);
                }
                if write {
                    self.walk(mem, data, len)?;
                    // Data in one piece that is here already (in the memory buffer, or read
                    // ahead for this command) goes to the backing store from there, without a
                    // copy.
                    let in_place = match self.runs[..] {
                        [(addr, n)] => mem.local(addr, n),
                        _ => None,
                    };
                    let written = match in_place {
                        Some(bytes) => {
                            self.stats.writes_in_place += 1;
                            self.backing.write_at(slba * lba, bytes)
                        }
                        None => {
                            self.copy_runs(mem, false)?;
                            self.backing.write_at(slba * lba, &self.data[..len])
                        }
                    };
                    written.map_err(|_| Status::WRITE_FAULT)?;
                    if fua {
                        self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                    }
                    self.stats.bytes_written += len as u64;
                } else {
                    self.backing
                        .read_at(slba * lba, &mut self.data[..len])
                        .map_err(|_| Status::UNRECOVERED_READ_ERROR)?;
                    self.transfer(mem, data, len, true)?;
                    self.stats.bytes_read += len as u64;
                }
                Ok(Some(0))
            }
            IoCommand::Flush { nsid } => {
                if nsid != 0xFFFF_FFFF {
                    self.check_nsid(nsid)?;
                }
                self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                Ok(Some(0))
            }
            IoCommand::WriteZeroes { nsid, slba, blocks, deallocate, fua } => {
                self.check_nsid(nsid)?;
                self.check_range(slba, u64::from(blocks))?;
                let (off, len) = (slba * lba, u64::from(blocks) * lba);
                let r = if deallocate {
                    self.backing.deallocate(off, len)
                } else {
                    self.backing.write_zeroes(off, len)
                };
                r.map_err(|_| Status::WRITE_FAULT)?;
                if fua {
                    self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                }
                Ok(Some(0))
            }
            IoCommand::DatasetManagement { nsid, ranges, deallocate, data } => {
                self.check_nsid(nsid)?;
                let len = usize::from(ranges) * 16;
                if self.data.len() < len {
                    self.data.resize(len, 0);
                }
                self.transfer(mem, data, len, false)?;
                let mut list = [(0u64, 0u64); 256];
                for (i, r) in self.data[..len].chunks_exact(16).enumerate() {
                    let blocks = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
                    let slba = u64::from_le_bytes(r[8..16].try_into().unwrap_or([0; 8]));
                    self.check_range(slba, blocks)?;
                    list[i] = (slba, blocks);
                }
                if deallocate {
                    for &(slba, blocks) in &list[..usize::from(ranges)] {
                        if blocks > 0 {
                            self.backing
                                .deallocate(slba * lba, blocks * lba)
                                .map_err(|_| Status::WRITE_FAULT)?;
                        }
                    }
                }
                Ok(Some(0))
            }
        }
    }
}
