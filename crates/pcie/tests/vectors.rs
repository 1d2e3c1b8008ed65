//! The TLP vectors (made by cocotbext-pcie, an independent PCIe model): every line of
//! `tlp/codec.jsonl` decodes to its fields and encodes back to its bytes; every line of
//! `tlp/completion_split.jsonl` yields exactly its request and completions.

use std::path::PathBuf;

use lanbus_pcie::json::{from_json, parse_hex, to_json};
use lanbus_pcie::request::{completions_for_read, split_completions, RequestShape};
use lanbus_pcie::{Bdf, Header, ReadReassembly, Tag, Tlp};
use serde_json::Value;

/// The TLP vectors made by cocotbext-pcie, committed as fixtures (see `fixtures/tlp/PROVENANCE.md`).
fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn lines(name: &str) -> Vec<(usize, String, Value)> {
    let path = vectors_dir().join("tlp").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let out: Vec<_> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            (i + 1, l.to_string(), serde_json::from_str(l).unwrap_or_else(|e| panic!("line {}: {e}", i + 1)))
        })
        .collect();
    assert!(out.len() >= 600, "{name}: only {} vectors", out.len());
    out
}

#[test]
fn codec_vectors_decode_and_encode() {
    for (n, line, v) in lines("codec.jsonl") {
        let bytes = parse_hex(v["hex"].as_str().unwrap()).unwrap();
        let tlp = Tlp::decode(&bytes).unwrap_or_else(|e| panic!("line {n}: decode: {e}"));
        let ours = to_json(&tlp);
        let ours_v: Value = serde_json::from_str(&ours).unwrap();
        assert_eq!(ours_v, v, "line {n}: decoded fields differ");
        assert_eq!(ours, line, "line {n}: key order or formatting differs");
        let back = from_json(&line).unwrap_or_else(|e| panic!("line {n}: from_json: {e}"));
        assert_eq!(back, tlp, "line {n}: JSON parse differs from decode");
        assert_eq!(back.encode().unwrap(), bytes, "line {n}: encoding differs");
    }
}

#[test]
fn completion_split_vectors() {
    for (n, _, v) in lines("completion_split.jsonl") {
        let u = |x: &Value| x.as_u64().unwrap();
        let (mps, rcb, address, len) =
            (u(&v["mps"]) as usize, u(&v["rcb"]) as usize, u(&v["address"]), u(&v["bytes"]) as usize);
        let s = RequestShape::for_range(address, len).unwrap();
        let r = &v["request"];
        assert_eq!(
            (u64::from(s.length_dw), u64::from(s.first_be), u64::from(s.last_be), s.address),
            (u(&r["length_dw"]), u(&r["first_be"]), u(&r["last_be"]), u(&r["address"])),
            "line {n}: request"
        );
        let want: Vec<(u64, u64, u64)> = v["completions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (u(&c["length_dw"]), u(&c["byte_count"]), u(&c["lower_address"])))
            .collect();
        let pieces = split_completions(address, len, mps, rcb).unwrap();
        let got: Vec<(u64, u64, u64)> = pieces
            .iter()
            .map(|p| (u64::from(p.length_dw), u64::from(p.byte_count), u64::from(p.lower_address)))
            .collect();
        assert_eq!(got, want, "line {n}: completions");

        // The same through TLPs: the request on the wire, the completer's completions, and the
        // requester putting them back together.
        let tag = Tag::new((n % 1024) as u16).unwrap();
        let rd = Tlp::mem_read(Bdf(0x0100), tag, s.address, s.length_dw, s.first_be, s.last_be);
        let rd = Tlp::decode(&rd.encode().unwrap()).unwrap();
        let pattern = |a: u64| (a.wrapping_mul(0x9e37_79b9) >> 7) as u8;
        let cpls = completions_for_read(&rd, Bdf(0x0200), mps, rcb, |a, buf| {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = pattern(a + i as u64);
            }
            Ok(())
        })
        .unwrap();
        let mut re = ReadReassembly::new(Bdf(0x0100), tag, address, len).unwrap();
        let mut got = vec![];
        for c in &cpls {
            let Header::Completion(h) = c.header else { panic!("line {n}: not a completion") };
            got.push((u64::from(c.length_dw), u64::from(h.byte_count), u64::from(h.lower_address)));
            let _ = re.handle_completion(&Tlp::decode(&c.encode().unwrap()).unwrap()).unwrap();
        }
        assert_eq!(got, want, "line {n}: completion TLPs");
        let data = re.into_data().unwrap();
        assert!(data.iter().enumerate().all(|(i, b)| *b == pattern(address + i as u64)), "line {n}: data");
    }
}
