//! The cluster's slot map: which primary serves each of the 16384 slots
//! (read with `CLUSTER SLOTS`, kept until a reply proves it stale) and the
//! slot of a key (CRC16 of its hash tag), so that a page of keys is read,
//! or a batch of write-backs sent, with one pipeline per primary (`route`).

use std::sync::Arc;

use redis::Value;

use super::{FastError, FastTier};

/// Slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// The slot of `key`, as Redis Cluster computes it: CRC16 (XMODEM) of the
/// key's hash tag (the bytes between its first `{` and the first `}` after
/// it, when not empty), else of the whole key, modulo 16384.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|b| *b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let mut crc: u16 = 0;
    for b in tagged.unwrap_or(key) {
        crc ^= u16::from(*b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS as u16
}

/// A primary, as `CLUSTER SLOTS` names it (the address the cluster client
/// keys its connections by).
pub(super) type Primary = (String, u16);

/// Which primary serves each slot.
#[derive(Debug)]
pub(super) struct SlotMap {
    /// Per slot, an index into `primaries` (`None`: no primary serves it).
    owner: Vec<Option<u16>>,
    primaries: Vec<Primary>,
}

impl SlotMap {
    /// The map a `CLUSTER SLOTS` reply describes: `[[start, end, [host,
    /// port, id, ...], replicas...], ...]`.
    pub(super) fn parse(ranges: &[Value]) -> Result<SlotMap, FastError> {
        let mut map = SlotMap {
            owner: vec![None; SLOTS],
            primaries: Vec::new(),
        };
        for range in ranges {
            let Value::Array(parts) = range else { continue };
            let int = |i: usize| -> Option<u16> {
                parts
                    .get(i)
                    .and_then(|v| redis::from_redis_value_ref(v).ok())
            };
            let (Some(start), Some(end)) = (int(0), int(1)) else {
                continue;
            };
            let Some(Value::Array(primary)) = parts.get(2) else {
                continue;
            };
            let host: Option<String> = primary
                .first()
                .and_then(|v| redis::from_redis_value_ref(v).ok());
            let port: Option<u16> = primary
                .get(1)
                .and_then(|v| redis::from_redis_value_ref(v).ok());
            let (Some(host), Some(port)) = (host, port) else {
                continue;
            };
            let node = (host, port);
            let at = match map.primaries.iter().position(|p| *p == node) {
                Some(at) => at,
                None => {
                    map.primaries.push(node);
                    map.primaries.len() - 1
                }
            };
            // Fewer than 16384 primaries: the index fits.
            let at = u16::try_from(at).ok();
            let end = usize::from(end).min(SLOTS - 1);
            for slot in usize::from(start)..=end {
                map.owner[slot] = at;
            }
        }
        if map.primaries.is_empty() {
            return Err(FastError::Protocol("CLUSTER SLOTS named no primary".into()));
        }
        Ok(map)
    }

    /// The primaries, in the order `CLUSTER SLOTS` first named them.
    pub(super) fn primaries(&self) -> &[Primary] {
        &self.primaries
    }

    /// The index (into [`SlotMap::primaries`]) of the primary serving `key`'s
    /// slot, if one does.
    pub(super) fn primary_of(&self, key: &[u8]) -> Option<usize> {
        self.owner
            .get(usize::from(slot_of(key)))
            .copied()
            .flatten()
            .map(usize::from)
    }
}

impl FastTier {
    /// The slot map: the one kept since the last `CLUSTER SLOTS`, or a fresh
    /// read (a background call) when there is none.
    pub(super) async fn slot_map(&self) -> Result<Arc<SlotMap>, FastError> {
        if let Some(map) = self
            .slot_map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Ok(map);
        }
        self.read_slot_map().await
    }

    /// Reads `CLUSTER SLOTS` (from any node) and keeps the map.
    pub(super) async fn read_slot_map(&self) -> Result<Arc<SlotMap>, FastError> {
        let ranges: Vec<Value> = self
            .call_background("cluster_slots", |mut c| async move {
                redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c).await
            })
            .await?;
        let map = Arc::new(SlotMap::parse(&ranges)?);
        *self.slot_map.write().unwrap_or_else(|p| p.into_inner()) = Some(map.clone());
        Ok(map)
    }

    /// Drops the kept slot map (a reply proved it stale, or a node failed):
    /// the next page or batch reads it again.
    pub(super) fn forget_slot_map(&self) {
        *self.slot_map.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use redis::cluster_routing::Slot;

    use super::*;

    #[test]
    fn slots_are_the_cluster_clients_slots() {
        for key in [
            "p:tok:{order_abc}",
            "p:tok:{}",
            "p:tok:{}{x}",
            "{a}{b}",
            "no-tag",
            "p:tok:{unclosed",
            "",
            "p:journal",
            "123456789",
        ] {
            assert_eq!(
                Slot::new(slot_of(key.as_bytes())),
                Some(Slot::for_key(key)),
                "{key}"
            );
        }
        // CRC16/XMODEM("123456789") is 0x31C3 (below 16384).
        assert_eq!(slot_of(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
    }

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn the_map_names_each_slots_primary() {
        let map = SlotMap::parse(&[
            range(0, 5460, "127.0.0.1", 7000),
            range(5461, 10922, "127.0.0.1", 7001),
            range(10923, 16000, "127.0.0.1", 7002),
            range(16001, 16383, "127.0.0.1", 7000),
        ])
        .expect("a map");
        assert_eq!(map.primaries().len(), 3);
        for key in ["a", "b", "c", "p:tok:{x}", "p:tok:{y}", "{z}"] {
            let slot = slot_of(key.as_bytes());
            let want = match slot {
                0..=5460 | 16001..=16383 => 7000,
                5461..=10922 => 7001,
                _ => 7002,
            };
            let at = map.primary_of(key.as_bytes()).expect("served");
            assert_eq!(map.primaries()[at].1, want, "{key} in slot {slot}");
        }
        let gap = SlotMap::parse(&[range(0, 100, "h", 1)]).expect("a map");
        let outside = (0..1000)
            .map(|i| format!("k{i}"))
            .find(|k| slot_of(k.as_bytes()) > 100)
            .expect("a key outside");
        assert_eq!(gap.primary_of(outside.as_bytes()), None);
        assert!(SlotMap::parse(&[Value::Nil]).is_err());
    }
}
