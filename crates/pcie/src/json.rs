//! TLPs as JSON, in the schema of the TLP test vectors (`tests/fixtures/tlp/PROVENANCE.md`).
//!
//! Layer: pcie engine, presentation only (for `lanbus tlp decode|encode` and the vector tests).
//! [`to_json`] writes the fields the vectors have for the TLP's kind, in the vectors' key order
//! and spacing, so a decoded vector line prints exactly as the line. The one addition: a TLP with
//! TD set (the vectors have none) also gets `"ecrc"` (8 hex digits) before `"hex"`.
//!
//! [`from_json`] is strict about names and ranges (an unknown key is an error, so a typo never
//! goes unnoticed) and lenient about what can be derived: `hex` is ignored; `fmt`/`type`, when
//! present, must agree with `kind`; `length_dw` defaults to the data length for data kinds and to
//! 1 for configuration and I/O requests; other fields default to zero/false, byte enables to
//! 0xf (first) and 0xf or 0 (last, by length).

use serde_json::{Map, Value};

use crate::tlp::{
    Attr, Bdf, CompletionHeader, ConfigHeader, CplStatus, Header, MemHeader, Tag, Tlp, TlpKind,
};
use crate::{Error, Result};

fn hex(bytes: &[u8]) -> String {
    use core::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses a hexadecimal string (whitespace ignored, an optional `0x` prefix allowed) into bytes.
pub fn parse_hex(text: &str) -> Result<Vec<u8>> {
    let t: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let t = t.strip_prefix("0x").unwrap_or(&t);
    if !t.len().is_multiple_of(2) {
        return Err(Error::Json(format!("hex string has an odd number of digits ({})", t.len())));
    }
    (0..t.len())
        .step_by(2)
        .map(|i| {
            t.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| Error::Json(format!("not a hex digit pair at offset {i}")))
        })
        .collect()
}

/// The TLP as one JSON object on one line, in the vector schema. The `hex` field is the TLP's
/// encoding (a TLP that cannot be encoded gets an empty `hex`).
pub fn to_json(tlp: &Tlp) -> String {
    let mut f: Vec<(&str, String)> = Vec::with_capacity(20);
    let q = |s: &str| format!("\"{s}\"");
    let b = |v: bool| v.to_string();
    let (fmt, ty) = tlp.kind.fmt_type();
    f.push(("kind", q(tlp.kind.name())));
    f.push(("fmt", fmt.to_string()));
    f.push(("type", ty.to_string()));
    f.push(("tc", tlp.tc.to_string()));
    f.push(("attr", tlp.attr.0.to_string()));
    f.push(("th", b(tlp.th)));
    f.push(("td", b(tlp.ecrc.is_some())));
    f.push(("ep", b(tlp.ep)));
    f.push(("at", tlp.at.to_string()));
    f.push(("ln", b(tlp.ln)));
    f.push(("length_dw", tlp.length_dw.to_string()));
    f.push(("tag", tlp.tag.get().to_string()));
    match &tlp.header {
        Header::Mem(h) => {
            f.push(("requester_id", q(&h.requester_id.to_string())));
            f.push(("first_be", h.first_be.to_string()));
            f.push(("last_be", h.last_be.to_string()));
            f.push(("address", h.address.to_string()));
            f.push(("ph", h.ph.to_string()));
        }
        Header::Config(h) => {
            f.push(("requester_id", q(&h.requester_id.to_string())));
            f.push(("first_be", h.first_be.to_string()));
            f.push(("last_be", h.last_be.to_string()));
            f.push(("completer_id", q(&h.completer_id.to_string())));
            f.push(("register", h.register.to_string()));
        }
        Header::Completion(h) => {
            f.push(("completer_id", q(&h.completer_id.to_string())));
            f.push(("status", u8::from(h.status).to_string()));
            f.push(("bcm", b(h.bcm)));
            f.push(("byte_count", h.byte_count.to_string()));
            f.push(("requester_id", q(&h.requester_id.to_string())));
            f.push(("lower_address", h.lower_address.to_string()));
        }
    }
    f.push(("data", q(&hex(&tlp.data))));
    if let Some(e) = tlp.ecrc {
        f.push(("ecrc", q(&format!("{e:08x}"))));
    }
    f.push(("hex", q(&tlp.encode().map(|v| hex(&v)).unwrap_or_default())));
    let body: Vec<String> = f.into_iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
    format!("{{{}}}", body.join(", "))
}

struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key)
    }

    fn uint(&mut self, key: &str, max: u64) -> Result<Option<u64>> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= max => Ok(Some(n)),
                _ => Err(Error::Json(format!("\"{key}\" must be an integer 0..={max}, not {v}"))),
            },
        }
    }

    fn uint_or(&mut self, key: &str, max: u64, default: u64) -> Result<u64> {
        Ok(self.uint(key, max)?.unwrap_or(default))
    }

    fn required(&mut self, key: &str, max: u64, kind: TlpKind) -> Result<u64> {
        self.uint(key, max)?.ok_or_else(|| Error::Json(format!("{kind} needs \"{key}\"")))
    }

    fn flag(&mut self, key: &str) -> Result<bool> {
        match self.take(key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(Error::Json(format!("\"{key}\" must be true or false, not {v}"))),
        }
    }

    fn string(&mut self, key: &str) -> Result<Option<String>> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Error::Json(format!("\"{key}\" must be a string, not {v}"))),
        }
    }

    fn bdf(&mut self, key: &str) -> Result<Bdf> {
        match self.string(key)? {
            None => Ok(Bdf::default()),
            Some(s) => s.parse().map_err(|e: Error| Error::Json(format!("\"{key}\": {e}"))),
        }
    }
}

/// Parses one JSON object in the vector schema into a TLP (checked to be encodable).
pub fn from_json(text: &str) -> Result<Tlp> {
    let v: Value = serde_json::from_str(text).map_err(|e| Error::Json(e.to_string()))?;
    let Value::Object(map) = v else {
        return Err(Error::Json("expected one JSON object".into()));
    };
    let mut f = Fields { map };
    let name = f.string("kind")?.ok_or_else(|| Error::Json("missing \"kind\"".into()))?;
    let kind = TlpKind::from_name(&name).ok_or_else(|| {
        let all: Vec<&str> = TlpKind::ALL.iter().map(|k| k.name()).collect();
        Error::Json(format!("unknown kind {name:?} (one of {})", all.join(" ")))
    })?;
    let (fmt, ty) = kind.fmt_type();
    if f.uint("fmt", 7)?.is_some_and(|v| v != u64::from(fmt))
        || f.uint("type", 31)?.is_some_and(|v| v != u64::from(ty))
    {
        return Err(Error::Json(format!(
            "\"fmt\"/\"type\" disagree with kind {kind} (fmt {fmt}, type {ty})"
        )));
    }
    f.take("hex");
    let data = parse_hex(&f.string("data")?.unwrap_or_default())?;
    let td = f.flag("td")?;
    let ecrc = match (td, f.string("ecrc")?) {
        (false, None) => None,
        (true, Some(s)) => {
            let b = parse_hex(&s)?;
            let b: [u8; 4] =
                b.try_into().map_err(|_| Error::Json("\"ecrc\" must be 4 bytes of hex".into()))?;
            Some(u32::from_be_bytes(b))
        }
        (true, None) => {
            return Err(Error::Json("\"td\": true needs \"ecrc\" (the digest, 8 hex digits)".into()))
        }
        (false, Some(_)) => return Err(Error::Json("\"ecrc\" given without \"td\": true".into())),
    };
    let default_len = if kind.has_data() {
        (data.len() / 4) as u64
    } else if kind == TlpKind::Cpl {
        0
    } else if kind.is_config() || matches!(kind, TlpKind::IORd) {
        1
    } else {
        u64::MAX
    };
    let length_dw = match f.uint("length_dw", 1024)? {
        Some(n) => n,
        None if default_len != u64::MAX => default_len,
        None => return Err(Error::Json(format!("{kind} needs \"length_dw\""))),
    } as u16;
    let tc = f.uint_or("tc", 7, 0)? as u8;
    let attr = Attr(f.uint_or("attr", 7, 0)? as u8);
    let th = f.flag("th")?;
    let ep = f.flag("ep")?;
    let at = f.uint_or("at", 3, 0)? as u8;
    let ln = f.flag("ln")?;
    let tag = Tag::new(f.uint_or("tag", 1023, 0)? as u16).expect("range checked");
    let header = if kind.is_completion() {
        let completer_id = f.bdf("completer_id")?;
        let status = CplStatus::from(f.uint_or("status", 7, 0)? as u8);
        let bcm = f.flag("bcm")?;
        let byte_count = f.required("byte_count", 4096, kind)? as u16;
        let requester_id = f.bdf("requester_id")?;
        let lower_address = f.uint_or("lower_address", 127, 0)? as u8;
        Header::Completion(CompletionHeader {
            completer_id,
            status,
            bcm,
            byte_count,
            requester_id,
            lower_address,
        })
    } else {
        let requester_id = f.bdf("requester_id")?;
        let first_be = f.uint_or("first_be", 15, 0xf)? as u8;
        let last_be = f.uint_or("last_be", 15, if length_dw > 1 { 0xf } else { 0 })? as u8;
        if kind.is_config() {
            let completer_id = f.bdf("completer_id")?;
            let register = f.required("register", 0xffc, kind)? as u16;
            Header::Config(ConfigHeader { requester_id, first_be, last_be, completer_id, register })
        } else {
            let address = f.required("address", u64::MAX, kind)?;
            let ph = f.uint_or("ph", 3, 0)? as u8;
            Header::Mem(MemHeader { requester_id, first_be, last_be, address, ph })
        }
    };
    if let Some(k) = f.map.keys().next() {
        return Err(Error::Json(format!("unknown or misplaced field \"{k}\" for {kind}")));
    }
    let tlp = Tlp { kind, tc, attr, th, ep, at, ln, ecrc, tag, length_dw, header, data };
    tlp.check()?;
    Ok(tlp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_text() {
        assert_eq!(parse_hex("0x0a Ff").unwrap(), vec![0x0a, 0xff]);
        assert!(parse_hex("abc").is_err());
        assert!(parse_hex("zz").is_err());
        assert_eq!(hex(&[0, 0xab]), "00ab");
    }

    #[test]
    fn defaults_and_errors() {
        let t = from_json(r#"{"kind": "MWr32", "address": 4096, "data": "01020304"}"#).unwrap();
        assert_eq!(t, Tlp::mem_write(Bdf(0), 4096, 0xf, 0, vec![1, 2, 3, 4]));
        let t =
            from_json(r#"{"kind": "MRd64", "address": 4294967296, "length_dw": 2, "tag": 1023}"#).unwrap();
        assert_eq!(t, Tlp::mem_read(Bdf(0), Tag::new(1023).unwrap(), 1 << 32, 2, 0xf, 0xf));
        for bad in [
            "[]",
            "{}",
            r#"{"kind": "MRd"}"#,
            r#"{"kind": "MRd32", "address": 0}"#,
            r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "tagg": 1}"#,
            r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "fmt": 1}"#,
            r#"{"kind": "MRd32", "address": 4294967296, "length_dw": 1}"#,
            r#"{"kind": "MWr32", "address": 0, "data": "010203"}"#,
            r#"{"kind": "MWr32", "address": 0, "data": "01020304", "length_dw": 2}"#,
            r#"{"kind": "CfgRd0", "register": 4096}"#,
            r#"{"kind": "Cpl", "byte_count": 0}"#,
            r#"{"kind": "Cpl", "byte_count": 4, "requester_id": "00:20.0"}"#,
            r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "td": true}"#,
            r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "tc": 8}"#,
            r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "th": 1}"#,
        ] {
            assert!(from_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn digest_is_carried() {
        let t =
            from_json(r#"{"kind": "MRd32", "address": 0, "length_dw": 1, "td": true, "ecrc": "01020304"}"#)
                .unwrap();
        assert_eq!(t.ecrc, Some(0x01020304));
        let bytes = t.encode().unwrap();
        assert_eq!(bytes.len(), 16);
        let text = to_json(&Tlp::decode(&bytes).unwrap());
        assert!(text.contains("\"td\": true") && text.contains("\"ecrc\": \"01020304\""), "{text}");
        assert_eq!(from_json(&text).unwrap(), t);
    }
}
