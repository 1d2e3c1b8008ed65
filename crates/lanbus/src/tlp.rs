//! `lanbus tlp decode|encode`: the TLP codec on the command line, in the JSON schema of the TLP
//! test vectors (`crates/pcie/tests/fixtures/tlp/PROVENANCE.md`).

use anyhow::Context;
use clap::Subcommand;
use lanbus_pcie::json::{from_json, parse_hex, to_json};
use lanbus_pcie::Tlp;

/// The TLP codec.
#[derive(Debug, Subcommand)]
pub enum TlpCommand {
    /// Prints the TLP in HEX (wire bytes, big-endian DWs, no framing or ECRC unless TD) as one
    /// JSON object.
    Decode {
        /// The TLP's bytes in hexadecimal (whitespace and a 0x prefix allowed).
        hex: String,
    },
    /// Prints the hexadecimal bytes of the TLP described by JSON (the decode schema; `hex` is
    /// ignored, most fields default to zero).
    Encode {
        /// One JSON object, e.g. '{"kind": "MRd32", "address": 4096, "length_dw": 1}'.
        json: String,
    },
}

/// Runs one codec command.
pub fn run(command: TlpCommand) -> anyhow::Result<()> {
    match command {
        TlpCommand::Decode { hex } => {
            let bytes = parse_hex(&hex).context("decode")?;
            let tlp = Tlp::decode(&bytes).context("decode")?;
            println!("{}", to_json(&tlp));
        }
        TlpCommand::Encode { json } => {
            let tlp = from_json(&json).context("encode")?;
            let bytes = tlp.encode().context("encode")?;
            println!("{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>());
        }
    }
    Ok(())
}
