//! `cargo run -p idempotency-ledger-model --release -- [--depth N] [--faults N] [--without-fix ITEM] [--item ITEM]`:
//! explores the model deeper than the test suite does and prints what it
//! finds. `--item` runs the scoped configuration of one fix of issue 24;
//! without it, every kind of fault. Exits 1 when an `always` property is
//! violated.

use idempotency_ledger_model::{explore, scenarios, Protocol, StopAt};

fn main() {
    let mut depth: u8 = 5;
    let mut faults: u8 = 2;
    let mut protocol = Protocol::TODAY;
    let mut item: Option<u8> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = |args: &mut dyn Iterator<Item = String>| -> u8 {
            match args.next().and_then(|v| v.parse().ok()) {
                Some(v) => v,
                None => {
                    eprintln!("{arg} needs a number");
                    std::process::exit(2);
                }
            }
        };
        match arg.as_str() {
            "--depth" => depth = value(&mut args),
            "--faults" => faults = value(&mut args),
            "--without-fix" => protocol = Protocol::without_fix(value(&mut args)),
            "--item" => item = Some(value(&mut args)),
            _ => {
                eprintln!(
                    "usage: model [--depth N] [--faults N] [--without-fix ITEM] [--item ITEM]"
                );
                std::process::exit(2);
            }
        }
    }
    let cfg = match item {
        Some(k) => match scenarios::item(k, protocol) {
            Some(mut cfg) => {
                cfg.max_time = depth;
                cfg
            }
            None => {
                eprintln!("--item takes 2 to 6, or 15");
                std::process::exit(2);
            }
        },
        None => scenarios::everything(protocol, depth, faults),
    };
    println!("exploring {cfg:?}");
    let out = explore(cfg, StopAt::Everything);
    println!(
        "{} states ({} distinct), depth {}, {:.1?}",
        out.states, out.unique_states, out.max_depth, out.elapsed
    );
    for name in out.discoveries.keys() {
        println!("{}", out.describe(name));
    }
    let violated = out.violations();
    if violated.is_empty() {
        println!("every property holds");
    } else {
        println!("violated: {violated:?}");
        std::process::exit(1);
    }
}
