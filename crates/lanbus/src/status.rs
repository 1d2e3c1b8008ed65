//! `lanbus status`: asks running daemons over their control sockets ([`lanbus_node::control`])
//! and prints the answer as an indented tree or as JSON.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::Value;

use lanbus_node::control::{self, DEVICE_CONTROL, HOST_CONTROL, STACK_CONTROL};

/// `lanbus status` options.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The daemon's control socket (default: both default sockets that exist).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

fn ask(path: &Path, line: &str) -> anyhow::Result<Value> {
    let reply = control::ask(path, line)?;
    serde_json::from_str(&reply).with_context(|| format!("bad reply from {}", path.display()))
}

fn print_value(v: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match v {
                    Value::Object(_) | Value::Array(_) => {
                        println!("{pad}{k}:");
                        print_value(v, indent + 2);
                    }
                    _ => println!("{pad}{k}: {}", scalar(v)),
                }
            }
        }
        Value::Array(a) => {
            for v in a {
                match v {
                    Value::Object(_) | Value::Array(_) => {
                        println!("{pad}-");
                        print_value(v, indent + 2);
                    }
                    _ => {
                        for (i, l) in scalar(v).lines().enumerate() {
                            println!("{pad}{}{l}", if i == 0 { "- " } else { "  " });
                        }
                    }
                }
            }
        }
        _ => println!("{pad}{}", scalar(v)),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Runs `lanbus status`.
pub fn run(args: StatusArgs) -> anyhow::Result<()> {
    let paths: Vec<PathBuf> = match args.control {
        Some(p) => vec![p],
        None => [HOST_CONTROL, DEVICE_CONTROL, STACK_CONTROL]
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect(),
    };
    if paths.is_empty() {
        bail!(
            "no daemon control socket at {HOST_CONTROL}, {DEVICE_CONTROL} or {}; give --control PATH",
            STACK_CONTROL
        );
    }
    for p in paths {
        let v = ask(&p, "status json")?;
        if args.json {
            println!("{v}");
        } else {
            println!("{}:", p.display());
            print_value(&v, 2);
        }
    }
    Ok(())
}
