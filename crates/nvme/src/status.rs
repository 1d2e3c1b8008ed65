//! NVMe completion status values (NVMe base specification 1.4 section 4.6.1, "Status Field
//! Definition"; 2.0: NVM Express Base 3.3.3.2): a status code type (SCT) and a status code (SC),
//! with the spec's name for each value this implementation produces.

use core::fmt;

/// A completion status: status code type and status code, plus the Do Not Retry bit.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    /// Status Code Type (0 generic, 1 command specific, 2 media and data integrity, 3 path).
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// Do Not Retry: the same command would fail again.
    pub dnr: bool,
}

macro_rules! statuses {
    ($($(#[$doc:meta])* $name:ident = ($sct:expr, $sc:expr, $dnr:expr, $text:expr);)*) => {
        impl Status {
            $($(#[$doc])* pub const $name: Status = Status { sct: $sct, sc: $sc, dnr: $dnr };)*

            /// The specification's name of this status, or a generic description.
            pub fn text(&self) -> &'static str {
                $(if self.sct == $sct && self.sc == $sc { return $text; })*
                match self.sct {
                    0 => "generic command status (unknown code)",
                    1 => "command specific status (unknown code)",
                    2 => "media and data integrity error (unknown code)",
                    3 => "path related status (unknown code)",
                    _ => "vendor specific status",
                }
            }
        }
    };
}

statuses! {
    /// Successful Completion.
    SUCCESS = (0, 0x00, false, "Successful Completion");
    /// Invalid Command Opcode.
    INVALID_OPCODE = (0, 0x01, true, "Invalid Command Opcode");
    /// Invalid Field in Command.
    INVALID_FIELD = (0, 0x02, true, "Invalid Field in Command");
    /// Command ID Conflict.
    CID_CONFLICT = (0, 0x03, true, "Command ID Conflict");
    /// Data Transfer Error (a DMA to or from host memory failed).
    DATA_TRANSFER_ERROR = (0, 0x04, false, "Data Transfer Error");
    /// Internal Error.
    INTERNAL_ERROR = (0, 0x06, false, "Internal Error");
    /// Command Abort Requested.
    ABORT_REQUESTED = (0, 0x07, false, "Command Abort Requested");
    /// Command Aborted due to SQ Deletion.
    ABORTED_SQ_DELETION = (0, 0x08, false, "Command Aborted due to SQ Deletion");
    /// Invalid Namespace or Format.
    INVALID_NAMESPACE = (0, 0x0B, true, "Invalid Namespace or Format");
    /// Command Sequence Error.
    COMMAND_SEQUENCE_ERROR = (0, 0x0C, true, "Command Sequence Error");
    /// Invalid SGL Segment Descriptor (a segment's length, or a segment descriptor where none
    /// may be).
    INVALID_SGL_SEGMENT_DESCRIPTOR = (0, 0x0D, true, "Invalid SGL Segment Descriptor");
    /// Invalid Number of SGL Descriptors.
    INVALID_SGL_DESCRIPTOR_COUNT = (0, 0x0E, true, "Invalid Number of SGL Descriptors");
    /// Data SGL Length Invalid (the data blocks do not add up to the transfer).
    DATA_SGL_LENGTH_INVALID = (0, 0x0F, true, "Data SGL Length Invalid");
    /// SGL Descriptor Type Invalid.
    SGL_DESCRIPTOR_TYPE_INVALID = (0, 0x11, true, "SGL Descriptor Type Invalid");
    /// Invalid Use of Controller Memory Buffer (an access straddles its edge).
    INVALID_CMB_USE = (0, 0x12, true, "Invalid Use of Controller Memory Buffer");
    /// PRP Offset Invalid.
    PRP_OFFSET_INVALID = (0, 0x13, true, "PRP Offset Invalid");
    /// LBA Out of Range.
    LBA_OUT_OF_RANGE = (0, 0x80, true, "LBA Out of Range");
    /// Completion Queue Invalid (Create I/O Submission Queue).
    CQ_INVALID = (1, 0x00, true, "Completion Queue Invalid");
    /// Invalid Queue Identifier.
    INVALID_QUEUE_ID = (1, 0x01, true, "Invalid Queue Identifier");
    /// Invalid Queue Size.
    INVALID_QUEUE_SIZE = (1, 0x02, true, "Invalid Queue Size");
    /// Abort Command Limit Exceeded.
    ABORT_LIMIT = (1, 0x03, true, "Abort Command Limit Exceeded");
    /// Asynchronous Event Request Limit Exceeded.
    AER_LIMIT = (1, 0x05, true, "Asynchronous Event Request Limit Exceeded");
    /// Invalid Interrupt Vector (Create I/O Completion Queue).
    INVALID_VECTOR = (1, 0x08, true, "Invalid Interrupt Vector");
    /// Invalid Log Page (Get Log Page).
    INVALID_LOG_PAGE = (1, 0x09, true, "Invalid Log Page");
    /// Invalid Queue Deletion (Delete I/O Completion Queue with SQs still attached).
    INVALID_QUEUE_DELETION = (1, 0x0C, true, "Invalid Queue Deletion");
    /// Feature Identifier Not Saveable.
    FEATURE_NOT_SAVEABLE = (1, 0x0D, true, "Feature Identifier Not Saveable");
    /// Write Fault (the backing store failed a write).
    WRITE_FAULT = (2, 0x80, false, "Write Fault");
    /// Unrecovered Read Error (the backing store failed a read).
    UNRECOVERED_READ_ERROR = (2, 0x81, false, "Unrecovered Read Error");
}

impl Status {
    /// Decodes the 15-bit status field of a completion entry (DW3 bits 31:17 shifted down).
    pub fn from_field(field: u16) -> Status {
        Status { sc: (field & 0xFF) as u8, sct: ((field >> 8) & 0x7) as u8, dnr: field & 0x4000 != 0 }
    }

    /// Encodes into the 15-bit status field (CRD and More are zero).
    pub fn to_field(self) -> u16 {
        u16::from(self.sc) | (u16::from(self.sct & 7) << 8) | if self.dnr { 0x4000 } else { 0 }
    }

    /// True for Successful Completion.
    pub fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// True if type and code match `other` (the DNR bit is ignored).
    pub fn same_code(&self, other: Status) -> bool {
        self.sct == other.sct && self.sc == other.sc
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (SCT {:#x}, SC {:#04x}{})",
            self.text(),
            self.sct,
            self.sc,
            if self.dnr { ", DNR" } else { "" }
        )
    }
}
