"""A tiny inventory model used as an editing workload."""

from dataclasses import dataclass, field


@dataclass
class Product:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0
    tags: list = field(default_factory=list)

    def total_value(self):
        return self.price_cents * self.quantity

    def restock(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.quantity += amount

    def sell(self, amount):
        if amount > self.quantity:
            raise ValueError("not enough stock")
        self.quantity -= amount
        return amount * self.price_cents


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, item):
        if item.sku in self.items:
            raise KeyError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def get(self, sku):
        return self.items[sku]

    def remove(self, sku):
        return self.items.pop(sku)

    def total_value(self):
        return sum(item.total_value() for item in self.items.values())

    def low_stock(self, threshold=5):
        return [item for item in self.items.values() if item.quantity < threshold]

    def by_tag(self, tag):
        return [item for item in self.items.values() if tag in item.tags]

    def report(self):
        lines = []
        for item in sorted(self.items.values(), key=lambda i: i.sku):
            lines.append(f"{item.sku:<10} {item.name:<20} {item.quantity:>5} {item.price_cents / 100:>8.2f}")
        lines.append(f"{'TOTAL':<36} {self.total_value() / 100:>8.2f}")
        return "\n".join(lines)


def load_items(rows):
    inventory = Inventory()
    for row in rows:
        inventory.add(
            Product(
                sku=row["sku"],
                name=row["name"],
                price_cents=int(row["price_cents"]),
                quantity=int(row.get("quantity", 0)),
                tags=row.get("tags", []),
            )
        )
    return inventory
